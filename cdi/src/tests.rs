//! Tests over CDI spec fixtures written into temp dirs. Device nodes stand in for GPUs through
//! the host's /dev/null, /dev/zero, /dev/full, /dev/random and /dev/urandom (c 1:3,5,7,8,9).

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use tempfile::TempDir;

use crate::*;

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    fs::create_dir_all(dir).unwrap();
    let p = dir.join(name);
    fs::write(&p, text).unwrap();
    p
}

fn base_spec() -> Value {
    json!({
        "ociVersion": "1.0.2",
        "process": {"user": {"uid": 0, "gid": 0}, "args": ["sh"], "env": ["PATH=/bin"]},
        "root": {"path": "rootfs"},
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
        "linux": {"resources": {"devices": [{"allow": false, "access": "rwm"}]}},
        "someFutureField": {"kept": true}
    })
}

fn devices_of(spec: &Value) -> Vec<(String, i64, i64)> {
    spec.pointer("/linux/devices")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|d| {
            (
                d["path"].as_str().unwrap().to_string(),
                d["major"].as_i64().unwrap_or(-1),
                d["minor"].as_i64().unwrap_or(-1),
            )
        })
        .collect()
}

fn mount_source(spec: &Value, dest: &str) -> Option<String> {
    spec["mounts"]
        .as_array()?
        .iter()
        .find(|m| m["destination"] == dest)
        .map(|m| m["source"].as_str().unwrap_or_default().to_string())
}

// ---- CDI spec versions --------------------------------------------------------------

/// A spec for each released version since 0.3.0, each using a field that version introduced.
#[test]
fn loads_every_spec_version_from_0_3_to_1_1() {
    let dir = TempDir::new().unwrap();
    let cases = [
        ("0.3.0", r#"deviceNodes: [{path: /dev/v030}]"#, "yaml"),
        (
            "0.4.0",
            r#"mounts: [{hostPath: /h, containerPath: /c, type: bind, options: [bind]}]"#,
            "yaml",
        ),
        (
            "0.5.0",
            r#"deviceNodes: [{path: /dev/v050, hostPath: /dev/zero}]"#,
            "yaml",
        ),
        ("0.6.0", r#"env: ["V=060"]"#, "yaml"),
        ("0.7.0", r#"additionalGids: [44]"#, "yaml"),
        ("0.8.0", r#"env: ["V=080"]"#, "yaml"),
        ("1.0.0", r#"env: ["V=100"]"#, "yaml"),
        (
            "1.1.0",
            r#"netDevices: [{hostInterfaceName: eth9, name: net0}]"#,
            "yaml",
        ),
    ];
    for (i, (version, edits, ext)) in cases.iter().enumerate() {
        let annotations = if *version >= "0.6.0" {
            "annotations: {a: b}\n"
        } else {
            ""
        };
        write(
            dir.path(),
            &format!("v{i}.{ext}"),
            &format!(
                "cdiVersion: \"{version}\"\nkind: v{i}.example.com/dev\n{annotations}devices:\n  - name: d\n    containerEdits: {{{edits}}}\n"
            ),
        );
    }
    // JSON is accepted as well.
    write(
        dir.path(),
        "json.json",
        r#"{"cdiVersion":"0.5.0","kind":"json.example.com/dev","devices":[{"name":"d","containerEdits":{"env":["J=1"]}}]}"#,
    );
    let reg = CdiRegistry::load(&[dir.path()]);
    assert!(reg.errors().is_empty(), "{:?}", reg.errors());
    assert_eq!(reg.device_names().len(), cases.len() + 1);

    let r = reg.resolve(&["v2.example.com/dev=d"]).unwrap();
    let mut spec = base_spec();
    apply_edits(&mut spec, &r.edits).unwrap();
    assert!(devices_of(&spec).contains(&("/dev/v050".into(), 1, 5)));

    let r = reg
        .resolve(&["v7.example.com/dev=d", "v4.example.com/dev=d"])
        .unwrap();
    assert_eq!(r.edits.net_devices[0].host_interface_name, "eth9");
    assert_eq!(r.edits.additional_gids, vec![44]);
    assert_eq!(
        reg.resolve(&["json.example.com/dev=d"]).unwrap().edits.env,
        vec!["J=1"]
    );
}

#[test]
fn broken_specs_give_errors_naming_file_and_problem() {
    let dir = TempDir::new().unwrap();
    let cases = [
        ("syntax.yaml", "cdiVersion: [oops\n", "syntax"),
        ("version.yaml", "cdiVersion: \"9.9.9\"\nkind: a.com/b\ndevices: [{name: d, containerEdits: {env: [A=1]}}]\n", "version"),
        ("too-old.yaml", "cdiVersion: \"0.3.0\"\nkind: b.com/b\ndevices: [{name: d, containerEdits: {deviceNodes: [{path: /dev/x, hostPath: /dev/null}]}}]\n", "0.5.0"),
        ("unknown-field.yaml", "cdiVersion: \"0.6.0\"\nkind: c.com/b\nbogus: 1\ndevices: [{name: d, containerEdits: {env: [A=1]}}]\n", "bogus"),
        ("no-devices.yaml", "cdiVersion: \"0.6.0\"\nkind: d.com/b\ndevices: []\n", "no devices"),
        ("bad-kind.yaml", "cdiVersion: \"0.6.0\"\nkind: nokind\ndevices: [{name: d, containerEdits: {env: [A=1]}}]\n", "kind"),
    ];
    for (name, text, _) in &cases {
        write(dir.path(), name, text);
    }
    write(dir.path(), "good.yaml", "cdiVersion: \"0.6.0\"\nkind: good.com/gpu\ndevices: [{name: \"0\", containerEdits: {env: [G=1]}}]\n");
    write(dir.path(), "notes.txt", "not a spec");

    let reg = CdiRegistry::load(&[dir.path()]);
    // The good spec still loads.
    assert_eq!(reg.device_names(), vec!["good.com/gpu=0"]);
    assert_eq!(reg.errors().len(), cases.len(), "{:#?}", reg.errors());
    for (name, _, needle) in &cases {
        let err = reg
            .errors()
            .iter()
            .find(|e| e.to_string().contains(name))
            .unwrap_or_else(|| panic!("no error names {name}: {:?}", reg.errors()));
        assert!(matches!(err, Error::InvalidSpec { .. }));
        assert!(
            err.to_string()
                .to_lowercase()
                .contains(&needle.to_lowercase()),
            "{name}: {err}"
        );
    }
    // An unknown device says so, and points at the files that did not load.
    let err = reg.resolve(&["a.com/b=d"]).unwrap_err();
    assert!(matches!(err, Error::UnknownDevice { .. }));
    let msg = err.to_string();
    assert!(
        msg.contains("unknown CDI device a.com/b=d") && msg.contains("version.yaml"),
        "{msg}"
    );
}

#[test]
fn conflicts_and_directory_priority() {
    let etc = TempDir::new().unwrap();
    let run = TempDir::new().unwrap();
    let spec = |v: &str| {
        format!("cdiVersion: \"0.6.0\"\nkind: x.com/gpu\ndevices: [{{name: \"0\", containerEdits: {{env: [W={v}]}}}}]\n")
    };
    write(etc.path(), "a.yaml", &spec("etc"));
    write(run.path(), "a.yaml", &spec("run"));
    let reg = CdiRegistry::load(&[etc.path(), run.path()]);
    assert_eq!(
        reg.resolve(&["x.com/gpu=0"]).unwrap().edits.env,
        vec!["W=run"]
    );

    write(etc.path(), "b.yaml", &spec("etc2"));
    let reg = CdiRegistry::load(&[etc.path()]);
    assert!(matches!(reg.errors()[0], Error::ConflictingDevice { .. }));
    assert!(reg.resolve(&["x.com/gpu=0"]).is_err());
}

// ---- names ------------------------------------------------------------------------

fn gpu_dir() -> TempDir {
    let dir = TempDir::new().unwrap();
    write(
        dir.path(),
        "nvidia.yaml",
        r#"
cdiVersion: "0.5.0"
kind: nvidia.com/gpu
containerEdits:
  deviceNodes: [{path: /dev/nvidiactl, hostPath: /dev/null}]
devices:
  - name: "0"
    containerEdits:
      env: ["NVIDIA_VISIBLE_DEVICES=GPU-aaaa"]
      deviceNodes: [{path: /dev/nvidia0, hostPath: /dev/zero}]
  - name: GPU-bbbb
    containerEdits:
      deviceNodes: [{path: /dev/nvidia1, hostPath: /dev/full}]
  - name: "10"
    containerEdits:
      deviceNodes: [{path: /dev/nvidia10, hostPath: /dev/random}]
"#,
    );
    write(
        dir.path(),
        "other.yaml",
        r#"
cdiVersion: "0.6.0"
kind: other.com/acc
devices:
  - name: all
    annotations: {uuids: "GPU-1,GPU-2"}
    containerEdits: {env: [ALL=1]}
  - name: one
    annotations: {uuid: GPU-3}
    containerEdits: {env: [ONE=1]}
"#,
    );
    dir
}

#[test]
fn resolves_all_uuid_and_rejects_bad_names() {
    let dir = gpu_dir();
    let reg = CdiRegistry::load(&[dir.path()]);
    assert!(reg.errors().is_empty(), "{:?}", reg.errors());

    // No "all" device in the spec: every device of the kind, in file order; spec edits once.
    let all = reg.resolve(&["nvidia.com/gpu=all"]).unwrap();
    let names: Vec<_> = all.devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "nvidia.com/gpu=0",
            "nvidia.com/gpu=GPU-bbbb",
            "nvidia.com/gpu=10"
        ]
    );
    assert_eq!(
        all.edits
            .device_nodes
            .iter()
            .filter(|n| n.path == "/dev/nvidiactl")
            .count(),
        1
    );

    // A spec's own "all" device wins; it carries two UUIDs, so it stands for none.
    let all = reg.resolve(&["other.com/acc=all"]).unwrap();
    assert_eq!(all.devices.len(), 1);
    assert_eq!(all.devices[0].gpu_uuid, None);

    // By UUID: device name, env, annotation.
    for (uuid, want) in [
        ("GPU-bbbb", "nvidia.com/gpu=GPU-bbbb"),
        ("GPU-aaaa", "nvidia.com/gpu=0"),
        ("GPU-3", "other.com/acc=one"),
    ] {
        let r = reg.resolve(&[uuid]).unwrap();
        assert_eq!(r.devices[0].name, want);
        assert_eq!(r.devices[0].gpu_uuid.as_deref(), Some(uuid));
    }
    assert!(matches!(
        reg.resolve(&["GPU-zzzz"]),
        Err(Error::UnknownDevice { .. })
    ));
    for bad in [
        "nvidia.com/gpu",
        "gpu=0",
        "nvidia.com/gpu=",
        "nvidia.com/g pu=0",
        "-x.com/gpu=0",
    ] {
        assert!(
            matches!(reg.resolve(&[bad]), Err(Error::InvalidDeviceName { .. })),
            "{bad}"
        );
    }
}

#[test]
fn apply_and_remove_edits_round_trip() {
    let dir = gpu_dir();
    let reg = CdiRegistry::load(&[dir.path()]);
    let r = reg.resolve(&["nvidia.com/gpu=0"]).unwrap();
    let mut spec = base_spec();
    spec["process"]["user"]["uid"] = json!(1000);
    apply_edits(&mut spec, &r.edits).unwrap();
    assert_eq!(
        devices_of(&spec),
        vec![
            ("/dev/nvidiactl".to_string(), 1, 3),
            ("/dev/nvidia0".to_string(), 1, 5)
        ]
    );
    assert_eq!(spec["linux"]["devices"][1]["uid"], 1000);
    let rules = spec["linux"]["resources"]["devices"].as_array().unwrap();
    assert!(rules
        .iter()
        .any(|r| r["major"] == 1 && r["minor"] == 5 && r["access"] == "rwm"));

    remove_edits(&mut spec, &r.edits);
    let mut want = base_spec();
    want["process"]["user"]["uid"] = json!(1000);
    assert_eq!(spec["linux"]["resources"], want["linux"]["resources"]);
    assert_eq!(spec["process"]["env"], want["process"]["env"]);
    assert!(devices_of(&spec).is_empty());
    assert_eq!(spec["someFutureField"], json!({"kept": true}));
}

#[test]
fn device_node_without_host_node_is_a_clear_error() {
    let dir = TempDir::new().unwrap();
    write(dir.path(), "x.yaml", "cdiVersion: \"0.5.0\"\nkind: x.com/gpu\ndevices: [{name: \"0\", containerEdits: {deviceNodes: [{path: /dev/g, hostPath: /dev/does-not-exist}]}}]\n");
    let reg = CdiRegistry::load(&[dir.path()]);
    let r = reg.resolve(&["x.com/gpu=0"]).unwrap();
    let err = apply_edits(&mut base_spec(), &r.edits).unwrap_err();
    assert!(err.to_string().contains("/dev/does-not-exist"), "{err}");
}

// ---- manifest -----------------------------------------------------------------------

#[test]
fn manifest_save_load_and_version_check() {
    let dir = gpu_dir();
    let reg = CdiRegistry::load(&[dir.path()]);
    let mut spec = base_spec();
    spec["annotations"] = json!({"cdi.k8s.io/plugin_x": "nvidia.com/gpu=0", "other": "v"});
    let r = reg.resolve(&["nvidia.com/gpu=0"]).unwrap();
    apply_edits(&mut spec, &r.edits).unwrap();

    let m = HostManifest::record(&spec, &reg, &RecordOptions::default()).unwrap();
    assert_eq!(m.cdi_device_names(), vec!["nvidia.com/gpu=0"]);
    assert_eq!(m.gpu_uuids, vec!["GPU-aaaa"], "taken from the device's env");
    let gpu0 = m
        .device_nodes
        .iter()
        .find(|n| n.path == "/dev/nvidia0")
        .unwrap();
    assert_eq!(
        (gpu0.kind.as_str(), gpu0.major, gpu0.minor),
        ("c", Some(1), Some(5))
    );
    assert_eq!(gpu0.host_path.as_deref(), Some("/dev/zero"));
    assert_eq!(gpu0.cdi_device.as_deref(), Some("nvidia.com/gpu=0"));

    let ckpt = TempDir::new().unwrap();
    let path = m.save(ckpt.path()).unwrap();
    assert_eq!(path, ckpt.path().join(MANIFEST_FILE));
    assert_eq!(HostManifest::load(ckpt.path()).unwrap(), m);

    let mut raw: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    raw["version"] = json!(MANIFEST_VERSION + 1);
    fs::write(&path, raw.to_string()).unwrap();
    let err = HostManifest::load(ckpt.path()).unwrap_err();
    assert!(
        matches!(err, Error::UnsupportedManifestVersion { .. }),
        "{err}"
    );

    // Unknown CDI device at checkpoint time: refuse to record a half manifest.
    let opts = RecordOptions {
        cdi_devices: vec!["nvidia.com/gpu=7".into()],
        ..Default::default()
    };
    assert!(matches!(
        HostManifest::record(&spec, &reg, &opts),
        Err(Error::UnknownDevice { .. })
    ));
}

// ---- checkpoint on one "host", restore on another --------------------------------

struct Hosts {
    _tmp: TempDir,
    src_cdi: PathBuf,
    dst_cdi: PathBuf,
    src_vol: PathBuf,
    dst_vol: PathBuf,
    src_lib: PathBuf,
    dst_lib: PathBuf,
}

fn hosts() -> Hosts {
    let tmp = TempDir::new().unwrap();
    let root = tmp.path().to_path_buf();
    let src_lib = write(&root.join("src/driver-550"), "libfake.so.1", "src");
    let dst_lib = write(
        &root.join("dst/usr/lib64/nvidia/550"),
        "libfake.so.1",
        "dst",
    );
    let src_vol = root.join("src/vol");
    let dst_vol = root.join("dst/volumes/data");
    fs::create_dir_all(&src_vol).unwrap();
    fs::create_dir_all(&dst_vol).unwrap();
    let shared = |lib: &Path, extra_arg: &str| {
        format!(
            r#"containerEdits:
  env: ["FAKE_DRIVER=550"]
  deviceNodes: [{{path: /dev/fakectl, hostPath: /dev/null}}]
  mounts: [{{hostPath: {}, containerPath: /usr/lib/libfake.so.1, options: [ro, nosuid, nodev, bind]}}]
  hooks: [{{hookName: createContainer, path: /usr/bin/fake-hook, args: [fake-hook, update-ldcache{extra_arg}]}}]
"#,
            lib.display()
        )
    };
    // Checkpoint host: an index-named CDI spec (0.6.0) whose devices carry UUIDs in annotations.
    write(
        &root.join("src/cdi"),
        "fake.yaml",
        &format!(
            r#"cdiVersion: "0.6.0"
kind: example.com/gpu
{}devices:
  - name: "0"
    annotations: {{uuid: GPU-aaaa}}
    containerEdits: {{deviceNodes: [{{path: /dev/fakegpu0, hostPath: /dev/zero}}]}}
  - name: "1"
    annotations: {{uuid: GPU-bbbb}}
    containerEdits: {{deviceNodes: [{{path: /dev/fakegpu1, hostPath: /dev/full}}]}}
"#,
            shared(&src_lib, "")
        ),
    );
    // Restore host: a 1.1.0 spec in JSON, devices named by UUID, other host nodes, other lib path.
    let dst_spec = json!({
        "cdiVersion": "1.1.0",
        "kind": "example.com/gpu",
        "containerEdits": {
            "env": ["FAKE_DRIVER=550"],
            "deviceNodes": [{"path": "/dev/fakectl", "hostPath": "/dev/null"}],
            "mounts": [{"hostPath": dst_lib, "containerPath": "/usr/lib/libfake.so.1",
                        "options": ["ro", "nosuid", "nodev", "bind"]}],
            "hooks": [{"hookName": "createContainer", "path": "/usr/bin/fake-hook",
                       "args": ["fake-hook", "update-ldcache", "--folder", "/usr/lib64/nvidia"]}]
        },
        "devices": [
            {"name": "GPU-cccc", "containerEdits": {"deviceNodes": [{"path": "/dev/fakegpu0", "hostPath": "/dev/urandom"}]}},
            {"name": "GPU-dddd", "containerEdits": {"deviceNodes": [{"path": "/dev/fakegpu1", "hostPath": "/dev/random"}]}},
            {"name": "GPU-eeee", "containerEdits": {"deviceNodes": [{"path": "/dev/fakegpu2", "hostPath": "/dev/zero"}]}}
        ]
    });
    write(&root.join("dst/cdi"), "fake.json", &dst_spec.to_string());
    Hosts {
        src_cdi: root.join("src/cdi"),
        dst_cdi: root.join("dst/cdi"),
        src_vol,
        dst_vol,
        src_lib,
        dst_lib,
        _tmp: tmp,
    }
}

/// The container as containerd would have created it on the checkpoint host.
fn checkpointed(h: &Hosts) -> (Value, HostManifest) {
    let reg = CdiRegistry::load(&[&h.src_cdi]);
    assert!(reg.errors().is_empty(), "{:?}", reg.errors());
    let mut spec = base_spec();
    spec["annotations"] = json!({"cdi.k8s.io/test_gpus": "example.com/gpu=0,example.com/gpu=1"});
    spec["mounts"].as_array_mut().unwrap().push(json!({
        "destination": "/data", "type": "bind", "source": h.src_vol, "options": ["rbind", "rw"]
    }));
    let names = cdi_devices_from_annotations(&spec);
    apply_edits(&mut spec, &reg.resolve(&names).unwrap().edits).unwrap();
    let opts = RecordOptions {
        gpu_uuids: vec!["GPU-aaaa".into(), "GPU-bbbb".into()],
        ..Default::default()
    };
    let m = HostManifest::record(&spec, &reg, &opts).unwrap();
    (spec, m)
}

#[test]
fn checkpoint_then_restore_on_another_host() {
    let h = hosts();
    let (old_spec, manifest) = checkpointed(&h);
    assert_eq!(manifest.bind_mounts.len(), 2);
    assert!(manifest
        .bind_mounts
        .iter()
        .any(|b| b.destination == "/usr/lib/libfake.so.1" && b.from_cdi));
    assert!(manifest
        .bind_mounts
        .iter()
        .any(|b| b.destination == "/data" && !b.from_cdi));

    // `ctr container restore` hands the shim the old spec; the volume moved on the new host.
    fs::remove_dir(&h.src_vol).unwrap();
    let bundle = TempDir::new().unwrap();
    let config = bundle.path().join("config.json");
    write_json_atomic(&config, &old_spec).unwrap();
    let reg = CdiRegistry::load(&[&h.dst_cdi]);
    let mut target = RestoreTarget {
        cdi_devices: Some(vec!["GPU-cccc".into(), "example.com/gpu=GPU-dddd".into()]),
        ..Default::default()
    };

    // Without saying where /data went, the old source is missing: refused before anything.
    let err = plan_restore_bundle(&manifest, &config, &reg, &target).unwrap_err();
    let Error::RestoreRefused(problems) = &err else {
        panic!("{err}")
    };
    assert_eq!(
        problems,
        &vec![RestoreProblem::MissingMountSource {
            destination: "/data".into(),
            source: h.src_vol.display().to_string(),
        }]
    );
    assert!(err.to_string().contains("/data"), "{err}");

    target
        .mount_sources
        .insert("/data".into(), h.dst_vol.display().to_string());
    let plan = plan_restore_bundle(&manifest, &config, &reg, &target).unwrap();
    let spec = &plan.spec;

    // Devices: the target's host nodes (urandom 1:9, random 1:8) under the same container paths.
    let mut devs = devices_of(spec);
    devs.sort();
    assert_eq!(
        devs,
        vec![
            ("/dev/fakectl".to_string(), 1, 3),
            ("/dev/fakegpu0".to_string(), 1, 9),
            ("/dev/fakegpu1".to_string(), 1, 8),
        ]
    );
    let rules: Vec<(i64, i64)> = spec["linux"]["resources"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["allow"] == true)
        .map(|r| (r["major"].as_i64().unwrap(), r["minor"].as_i64().unwrap()))
        .collect();
    assert_eq!(rules.len(), 3);
    assert!(
        !rules.contains(&(1, 5)) && !rules.contains(&(1, 7)),
        "old GPUs still allowed: {rules:?}"
    );

    // Mounts: driver lib from the target's CDI spec, volume from the override.
    assert_eq!(
        mount_source(spec, "/usr/lib/libfake.so.1").unwrap(),
        h.dst_lib.display().to_string()
    );
    assert_eq!(
        mount_source(spec, "/data").unwrap(),
        h.dst_vol.display().to_string()
    );
    assert_eq!(spec["mounts"].as_array().unwrap().len(), 3);
    let args: Vec<String> = plan.ext_mounts.iter().map(ExtMount::to_criu_arg).collect();
    assert_eq!(args.len(), 2);
    assert!(args.contains(&format!("/usr/lib/libfake.so.1:{}", h.dst_lib.display())));
    assert!(args.contains(&format!("/data:{}", h.dst_vol.display())));
    assert!(!args
        .iter()
        .any(|a| a.contains(&h.src_lib.display().to_string())));

    // Hooks and env: the target's, once.
    let hooks = spec["hooks"]["createContainer"].as_array().unwrap();
    assert_eq!(hooks.len(), 1);
    assert_eq!(hooks[0]["args"][3], "/usr/lib64/nvidia");
    let env = spec["process"]["env"].as_array().unwrap();
    assert_eq!(env.iter().filter(|e| *e == "FAKE_DRIVER=550").count(), 1);

    // UUIDs paired in device order; annotations name the new devices.
    assert_eq!(
        plan.gpu_uuid_pairs,
        vec![
            GpuUuidPair {
                old: "GPU-aaaa".into(),
                new: "GPU-cccc".into()
            },
            GpuUuidPair {
                old: "GPU-bbbb".into(),
                new: "GPU-dddd".into()
            },
        ]
    );
    assert_eq!(
        plan.cdi_devices,
        vec!["example.com/gpu=GPU-cccc", "example.com/gpu=GPU-dddd"]
    );
    assert_eq!(
        spec["annotations"][RESTORE_ANNOTATION],
        "example.com/gpu=GPU-cccc,example.com/gpu=GPU-dddd"
    );
    assert!(spec["annotations"].get("cdi.k8s.io/test_gpus").is_none());
    assert_eq!(spec["someFutureField"], json!({"kept": true}));

    // Planning again over the written spec changes nothing (hooks are not doubled).
    plan.write_spec(&config).unwrap();
    let again = plan_restore_bundle(&manifest, &config, &reg, &target).unwrap();
    assert_eq!(again.spec, plan.spec);
}

#[test]
fn restore_refuses_a_host_that_differs() {
    let h = hosts();
    let (old_spec, manifest) = checkpointed(&h);

    // One GPU instead of two, plus an unknown device.
    let reg = CdiRegistry::load(&[&h.dst_cdi]);
    let target = RestoreTarget {
        cdi_devices: Some(vec!["GPU-cccc".into(), "example.com/gpu=7".into()]),
        ..Default::default()
    };
    let Err(Error::RestoreRefused(p)) = plan_restore(&manifest, &old_spec, &reg, &target) else {
        panic!("expected refusal")
    };
    assert!(p.iter().any(|x| matches!(x, RestoreProblem::UnresolvableDevice { name, .. } if name == "example.com/gpu=7")), "{p:?}");
    assert!(
        p.contains(&RestoreProblem::GpuCountMismatch {
            recorded: 2,
            target: 1
        }),
        "{p:?}"
    );

    // Three GPUs for a two-GPU checkpoint.
    let target = RestoreTarget {
        cdi_devices: Some(vec![
            "GPU-cccc".into(),
            "GPU-dddd".into(),
            "GPU-eeee".into(),
        ]),
        ..Default::default()
    };
    let Err(Error::RestoreRefused(p)) = plan_restore(&manifest, &old_spec, &reg, &target) else {
        panic!("expected refusal")
    };
    assert!(
        p.iter()
            .any(|x| matches!(x, RestoreProblem::DeviceCountMismatch { .. })),
        "{p:?}"
    );
    assert!(
        p.contains(&RestoreProblem::GpuCountMismatch {
            recorded: 2,
            target: 3
        }),
        "{p:?}"
    );

    // Same names as recorded ("0", "1") do not exist on the target's spec.
    let Err(Error::RestoreRefused(p)) =
        plan_restore(&manifest, &old_spec, &reg, &RestoreTarget::default())
    else {
        panic!("expected refusal")
    };
    assert_eq!(
        p.iter()
            .filter(|x| matches!(x, RestoreProblem::UnresolvableDevice { .. }))
            .count(),
        2
    );

    // A driver whose library sits at another container path: CRIU's recorded mount has no home.
    let other = TempDir::new().unwrap();
    let lib = write(other.path(), "libfake.so.2", "x");
    write(&other.path().join("cdi"), "f.yaml", &format!(
        "cdiVersion: \"0.6.0\"\nkind: example.com/gpu\ndevices:\n  - name: GPU-cccc\n    containerEdits: {{mounts: [{{hostPath: {}, containerPath: /usr/lib/libfake.so.2, options: [bind]}}]}}\n  - name: GPU-dddd\n    containerEdits: {{env: [X=1]}}\n",
        lib.display()));
    let reg = CdiRegistry::load(&[other.path().join("cdi")]);
    let target = RestoreTarget {
        cdi_devices: Some(vec!["GPU-cccc".into(), "GPU-dddd".into()]),
        ..Default::default()
    };
    let err = plan_restore(&manifest, &old_spec, &reg, &target).unwrap_err();
    let Error::RestoreRefused(p) = &err else {
        panic!("{err}")
    };
    assert!(
        p.contains(&RestoreProblem::MountMissingInTarget {
            destination: "/usr/lib/libfake.so.1".into()
        }),
        "{p:?}"
    );
    assert!(
        err.to_string()
            .contains("/usr/lib/libfake.so.1 was in the checkpoint"),
        "{err}"
    );

    // Target UUIDs that cannot be known refuse too, unless the caller gives them.
    let target = RestoreTarget {
        cdi_devices: Some(vec![
            "example.com/gpu=GPU-cccc".into(),
            "example.com/gpu=GPU-dddd".into(),
        ]),
        gpu_uuids: Some(vec!["GPU-x".into()]),
        ..Default::default()
    };
    let reg = CdiRegistry::load(&[&h.dst_cdi]);
    let Err(Error::RestoreRefused(p)) = plan_restore(&manifest, &old_spec, &reg, &target) else {
        panic!("expected refusal")
    };
    assert_eq!(
        p,
        vec![RestoreProblem::GpuCountMismatch {
            recorded: 2,
            target: 1
        }]
    );
}

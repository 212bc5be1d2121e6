//! Task metrics: one `runc events --stats` sample converted to containerd's cgroup v1 or v2
//! metrics type (whichever the host runs), so `ctr task metrics` and the CRI stats work with
//! either hierarchy without the shim linking a cgroup library.

use containerd_shim_protos::{
    cgroups::metrics as v1,
    cgroups_v2::metrics as v2,
    protobuf::{well_known_types::any::Any, Message, MessageField},
};
use serde_json::Value;

use crate::error::Result;

/// True on a pure cgroup v2 host.
pub fn cgroup_v2() -> bool {
    std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists()
}

fn u(v: &Value, path: &[&str]) -> u64 {
    let mut cur = v;
    for p in path {
        match cur.get(p) {
            Some(n) => cur = n,
            None => return 0,
        }
    }
    cur.as_u64().unwrap_or(0)
}

/// Converts runc's stats JSON (`types.Stats`) into an `Any` for StatsResponse.
pub fn to_metrics_any(stats: &Value, v2_host: bool) -> Result<Any> {
    let (type_url, value) = if v2_host {
        (
            "io.containerd.cgroups.v2.Metrics",
            to_v2(stats).write_to_bytes()?,
        )
    } else {
        (
            "io.containerd.cgroups.v1.Metrics",
            to_v1(stats).write_to_bytes()?,
        )
    };
    Ok(Any {
        type_url: type_url.into(),
        value,
        ..Default::default()
    })
}

fn mem_entry(v: &Value, key: &str) -> MessageField<v1::MemoryEntry> {
    MessageField::some(v1::MemoryEntry {
        limit: u(v, &["memory", key, "limit"]),
        usage: u(v, &["memory", key, "usage"]),
        max: u(v, &["memory", key, "max"]),
        failcnt: u(v, &["memory", key, "failcnt"]),
        ..Default::default()
    })
}

pub fn to_v1(s: &Value) -> v1::Metrics {
    let raw = |k: &str| u(s, &["memory", "raw", k]);
    let per_cpu = s
        .pointer("/cpu/usage/percpu")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    let mut blkio = v1::BlkIOStat::default();
    if let Some(entries) = s
        .pointer("/blkio/ioServiceBytesRecursive")
        .and_then(Value::as_array)
    {
        blkio.io_service_bytes_recursive = entries.iter().map(blk_entry).collect();
    }
    if let Some(entries) = s
        .pointer("/blkio/ioServicedRecursive")
        .and_then(Value::as_array)
    {
        blkio.io_serviced_recursive = entries.iter().map(blk_entry).collect();
    }
    let hugetlb = s
        .get("hugetlb")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(size, h)| v1::HugetlbStat {
                    pagesize: size.clone(),
                    usage: u(h, &["usage"]),
                    max: u(h, &["max"]),
                    failcnt: u(h, &["failcnt"]),
                    ..Default::default()
                })
                .collect()
        })
        .unwrap_or_default();
    v1::Metrics {
        cpu: MessageField::some(v1::CPUStat {
            usage: MessageField::some(v1::CPUUsage {
                total: u(s, &["cpu", "usage", "total"]),
                kernel: u(s, &["cpu", "usage", "kernel"]),
                user: u(s, &["cpu", "usage", "user"]),
                per_cpu,
                ..Default::default()
            }),
            throttling: MessageField::some(v1::Throttle {
                periods: u(s, &["cpu", "throttling", "periods"]),
                throttled_periods: u(s, &["cpu", "throttling", "throttled_periods"]),
                throttled_time: u(s, &["cpu", "throttling", "throttled_time"]),
                ..Default::default()
            }),
            ..Default::default()
        }),
        memory: MessageField::some(v1::MemoryStat {
            cache: raw("cache"),
            rss: raw("rss"),
            rss_huge: raw("rss_huge"),
            mapped_file: raw("mapped_file"),
            dirty: raw("dirty"),
            writeback: raw("writeback"),
            pg_pg_in: raw("pgpgin"),
            pg_pg_out: raw("pgpgout"),
            pg_fault: raw("pgfault"),
            pg_maj_fault: raw("pgmajfault"),
            inactive_anon: raw("inactive_anon"),
            active_anon: raw("active_anon"),
            inactive_file: raw("inactive_file"),
            active_file: raw("active_file"),
            unevictable: raw("unevictable"),
            hierarchical_memory_limit: raw("hierarchical_memory_limit"),
            hierarchical_swap_limit: raw("hierarchical_memsw_limit"),
            total_cache: raw("total_cache"),
            total_rss: raw("total_rss"),
            total_rss_huge: raw("total_rss_huge"),
            total_mapped_file: raw("total_mapped_file"),
            total_dirty: raw("total_dirty"),
            total_writeback: raw("total_writeback"),
            total_pg_pg_in: raw("total_pgpgin"),
            total_pg_pg_out: raw("total_pgpgout"),
            total_pg_fault: raw("total_pgfault"),
            total_pg_maj_fault: raw("total_pgmajfault"),
            total_inactive_anon: raw("total_inactive_anon"),
            total_active_anon: raw("total_active_anon"),
            total_inactive_file: raw("total_inactive_file"),
            total_active_file: raw("total_active_file"),
            total_unevictable: raw("total_unevictable"),
            usage: mem_entry(s, "usage"),
            swap: mem_entry(s, "swap"),
            kernel: mem_entry(s, "kernel"),
            kernel_tcp: mem_entry(s, "kernel_tcp"),
            ..Default::default()
        }),
        pids: MessageField::some(v1::PidsStat {
            current: u(s, &["pids", "current"]),
            limit: u(s, &["pids", "limit"]),
            ..Default::default()
        }),
        blkio: MessageField::some(blkio),
        hugetlb,
        ..Default::default()
    }
}

fn blk_entry(e: &Value) -> v1::BlkIOEntry {
    v1::BlkIOEntry {
        op: e.get("op").and_then(Value::as_str).unwrap_or("").into(),
        major: u(e, &["major"]),
        minor: u(e, &["minor"]),
        value: u(e, &["value"]),
        ..Default::default()
    }
}

pub fn to_v2(s: &Value) -> v2::Metrics {
    let raw = |k: &str| u(s, &["memory", "raw", k]);
    // runc reports cgroup v2 CPU times in nanoseconds; containerd's v2 type wants µs.
    let usec = |k: &str| u(s, &["cpu", "usage", k]) / 1000;
    v2::Metrics {
        cpu: MessageField::some(v2::CPUStat {
            usage_usec: usec("total"),
            user_usec: usec("user"),
            system_usec: usec("kernel"),
            nr_periods: u(s, &["cpu", "throttling", "periods"]),
            nr_throttled: u(s, &["cpu", "throttling", "throttled_periods"]),
            throttled_usec: u(s, &["cpu", "throttling", "throttled_time"]) / 1000,
            ..Default::default()
        }),
        memory: MessageField::some(v2::MemoryStat {
            anon: raw("anon"),
            file: raw("file"),
            kernel_stack: raw("kernel_stack"),
            slab: raw("slab"),
            sock: raw("sock"),
            shmem: raw("shmem"),
            file_mapped: raw("file_mapped"),
            file_dirty: raw("file_dirty"),
            file_writeback: raw("file_writeback"),
            anon_thp: raw("anon_thp"),
            inactive_anon: raw("inactive_anon"),
            active_anon: raw("active_anon"),
            inactive_file: raw("inactive_file"),
            active_file: raw("active_file"),
            unevictable: raw("unevictable"),
            slab_reclaimable: raw("slab_reclaimable"),
            slab_unreclaimable: raw("slab_unreclaimable"),
            pgfault: raw("pgfault"),
            pgmajfault: raw("pgmajfault"),
            usage: u(s, &["memory", "usage", "usage"]),
            usage_limit: u(s, &["memory", "usage", "limit"]),
            max_usage: u(s, &["memory", "usage", "max"]),
            swap_usage: u(s, &["memory", "swap", "usage"]),
            swap_limit: u(s, &["memory", "swap", "limit"]),
            ..Default::default()
        }),
        pids: MessageField::some(v2::PidsStat {
            current: u(s, &["pids", "current"]),
            limit: u(s, &["pids", "limit"]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Value {
        serde_json::json!({
            "cpu": {"usage": {"total": 5000, "percpu": [3000, 2000], "kernel": 1000, "user": 4000},
                    "throttling": {"periods": 1, "throttled_periods": 0, "throttled_time": 0}},
            "memory": {"usage": {"usage": 4096, "limit": 1048576, "max": 8192, "failcnt": 0},
                       "raw": {"rss": 100, "cache": 200, "anon": 300, "file": 400}},
            "pids": {"current": 3, "limit": 100},
            "blkio": {"ioServiceBytesRecursive": [{"major": 8, "minor": 0, "op": "Read", "value": 1}]}
        })
    }

    #[test]
    fn v1_metrics_from_runc_stats() {
        let m = to_v1(&sample());
        assert_eq!(m.cpu.usage.total, 5000);
        assert_eq!(m.cpu.usage.per_cpu, vec![3000, 2000]);
        assert_eq!(m.memory.usage.usage, 4096);
        assert_eq!(m.memory.usage.limit, 1048576);
        assert_eq!(m.memory.rss, 100);
        assert_eq!(m.pids.current, 3);
        assert_eq!(m.blkio.io_service_bytes_recursive[0].op, "Read");
        let any = to_metrics_any(&sample(), false).unwrap();
        assert_eq!(any.type_url, "io.containerd.cgroups.v1.Metrics");
    }

    #[test]
    fn v2_metrics_from_runc_stats() {
        let m = to_v2(&sample());
        assert_eq!(m.cpu.usage_usec, 5);
        assert_eq!(m.memory.usage, 4096);
        assert_eq!(m.memory.anon, 300);
        assert_eq!(m.pids.limit, 100);
        let any = to_metrics_any(&sample(), true).unwrap();
        assert_eq!(any.type_url, "io.containerd.cgroups.v2.Metrics");
    }
}

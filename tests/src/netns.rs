//! A second "node" on its own network: a network namespace joined to this one by a veth
//! pair, so a daemon started in it reaches this host only through the pair's address (as
//! another machine reaches a shared store over the network).

use std::process::Command;

use crate::error::{HarnessError, Result};

/// A network namespace `name` with the veth pair's far end in it (`peer_ip`, loopback up)
/// and the near end here (`host_ip`); removed on drop.
pub struct NetNs {
    pub name: String,
    pub host_ip: String,
    pub peer_ip: String,
    host_if: String,
}

fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|source| HarnessError::Spawn {
            command: format!("ip {}", args.join(" ")),
            source,
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(HarnessError::Unexpected(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

impl NetNs {
    /// A namespace on `10.<a>.<b>.0/30`, the subnet picked from this process's id and `n`
    /// so that concurrent tests do not collide.
    pub fn create(n: u8) -> Result<NetNs> {
        let pid = std::process::id();
        let name = format!("gpucr-n{pid}-{n}");
        let host_if = format!("gv{}h{n}", pid % 100_000);
        let peer_if = format!("gv{}p{n}", pid % 100_000);
        let (a, b) = (200 + (pid % 50) as u8, ((pid / 50) % 64) as u8 * 4);
        let net = format!("10.{a}.{b}");
        let (host_ip, peer_ip) = (format!("{net}.1"), format!("{net}.2"));
        let ns = NetNs {
            name: name.clone(),
            host_ip: host_ip.clone(),
            peer_ip: peer_ip.clone(),
            host_if: host_if.clone(),
        };
        ip(&["netns", "add", &name])?;
        ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", &peer_if,
        ])?;
        ip(&["link", "set", &peer_if, "netns", &name])?;
        ip(&["addr", "add", &format!("{host_ip}/30"), "dev", &host_if])?;
        ip(&["link", "set", &host_if, "up"])?;
        let peer_cidr = format!("{peer_ip}/30");
        ip(&["-n", &name, "addr", "add", &peer_cidr, "dev", &peer_if])?;
        ip(&["-n", &name, "link", "set", &peer_if, "up"])?;
        ip(&["-n", &name, "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// `/run/netns/NAME`, what `setns` joins.
    pub fn path(&self) -> std::path::PathBuf {
        std::path::Path::new("/run/netns").join(&self.name)
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        // Removing one end of the pair removes both.
        let _ = ip(&["link", "del", &self.host_if]);
        let _ = ip(&["netns", "del", &self.name]);
    }
}

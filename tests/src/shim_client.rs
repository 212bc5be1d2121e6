//! Talking to a task's shim directly over ttrpc, for calls `ctr` 1.7 lacks (`Update`).

use containerd_shim_protos::api::UpdateTaskRequest;
use containerd_shim_protos::shim_sync::{Client, TaskClient};
use containerd_shim_protos::ttrpc::context;
use protobuf::well_known_types::any::Any;
use serde_json::json;

use crate::containerd::Containerd;
use crate::error::{HarnessError, Result};

/// containerd's ttrpc metadata key for the namespace.
const NAMESPACE_HEADER: &str = "containerd-namespace-ttrpc";
/// Type URL containerd uses for JSON `LinuxResources`.
const LINUX_RESOURCES_TYPE_URL: &str =
    "types.containerd.io/opencontainers/runtime-spec/1/LinuxResources";
const RPC_TIMEOUT_NS: i64 = 10_000_000_000;

impl Containerd {
    /// The shim's ttrpc address, from the `address` file in the task's bundle.
    pub fn shim_address(&self, id: &str) -> Result<String> {
        let path = self.bundle(id).join("address");
        let address = std::fs::read_to_string(&path)
            .map_err(HarnessError::io("read shim address file", &path))?;
        Ok(address.trim().to_owned())
    }

    /// A ttrpc Task client connected to the shim of task `id`, and a call context carrying
    /// this daemon's namespace.
    pub fn shim_client(&self, id: &str) -> Result<(TaskClient, context::Context)> {
        let client = Client::connect(&self.shim_address(id)?)?;
        let mut ctx = context::with_timeout(RPC_TIMEOUT_NS);
        ctx.add(NAMESPACE_HEADER.to_owned(), self.namespace().to_owned());
        Ok((TaskClient::new(client), ctx))
    }

    /// Sets the task's memory limit through the shim's `Update` RPC, the way containerd's
    /// `Task.Update` forwards `LinuxResources` (JSON in an `Any`).
    pub fn update_memory_limit(&self, id: &str, limit: u64) -> Result<()> {
        let (client, ctx) = self.shim_client(id)?;
        let resources = json!({ "memory": { "limit": limit } });
        let request = UpdateTaskRequest {
            id: id.to_owned(),
            resources: protobuf::MessageField::some(Any {
                type_url: LINUX_RESOURCES_TYPE_URL.to_owned(),
                value: serde_json::to_vec(&resources)?,
                ..Default::default()
            }),
            ..Default::default()
        };
        client.update(ctx, &request)?;
        Ok(())
    }
}

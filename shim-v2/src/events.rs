//! Task events go out through [`EventSender`]: in production a forwarder over containerd's
//! ttrpc events service (the crate's publisher queues and retries); in tests an mpsc sender.

use std::time::SystemTime;

use async_trait::async_trait;
use containerd_shim::{event::Event, publisher::RemotePublisher, Context};
use containerd_shim_protos::protobuf::{well_known_types::timestamp::Timestamp, MessageDyn};

#[async_trait]
pub trait EventSender: Send + Sync {
    async fn send(&self, topic: String, event: Box<dyn MessageDyn>);
}

/// Publishes to containerd under the shim's namespace.
pub struct Publisher {
    pub remote: RemotePublisher,
    pub namespace: String,
}

#[async_trait]
impl EventSender for Publisher {
    async fn send(&self, topic: String, event: Box<dyn MessageDyn>) {
        if let Err(e) = self
            .remote
            .publish(Context::default(), &topic, &self.namespace, event)
            .await
        {
            tracing::error!(topic, "publishing event: {e}");
        }
    }
}

/// For tests: events land on a channel as (topic, message).
#[async_trait]
impl EventSender for tokio::sync::mpsc::UnboundedSender<(String, Box<dyn MessageDyn>)> {
    async fn send(&self, topic: String, event: Box<dyn MessageDyn>) {
        let _ = tokio::sync::mpsc::UnboundedSender::send(self, (topic, event));
    }
}

pub async fn publish<E: Event + 'static>(sender: &dyn EventSender, event: E) {
    let topic = event.topic();
    tracing::debug!(topic, "event");
    sender.send(topic, Box::new(event)).await;
}

pub fn timestamp(t: SystemTime) -> Timestamp {
    let d = t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    Timestamp {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
        ..Default::default()
    }
}

//! The gRPC service Envoy calls: `envoy.service.ext_proc.v3.ExternalProcessor/Process`, one
//! bidirectional stream per HTTP request, each driven by an [`Exchange`].

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures_util::Stream;
use switchyard_gateway::Gateway;
use tonic::{Request, Response, Status, Streaming};

use crate::exchange::{BodyWatch, Exchange};

/// The endpoint picker service.
pub struct Picker {
    gw: Arc<Gateway>,
    bodies: BodyWatch,
}

impl Picker {
    /// Over the gateway state `gw`.
    pub fn new(gw: Arc<Gateway>, bodies: BodyWatch) -> Self {
        Picker { gw, bodies }
    }
}

/// One stream's state between answers: Envoy's messages, the exchange, and answers not yet
/// sent (a message may produce several).
struct Conversation {
    inbound: Streaming<ProcessingRequest>,
    exchange: Option<Exchange>,
    outbox: VecDeque<ProcessingResponse>,
}

impl Drop for Conversation {
    /// Dropped before Envoy closed its side: the stream was cut (the client left, or Envoy
    /// gave up); what is unsettled counts as cancelled.
    fn drop(&mut self) {
        if let Some(exchange) = self.exchange.take() {
            exchange.close(false);
        }
    }
}

/// The answers, produced as Envoy's messages are read: the exchange runs in the task that
/// serves the gRPC stream, so no message crosses tasks (each crossing is a wake-up).
fn answers(
    conversation: Conversation,
) -> impl Stream<Item = Result<ProcessingResponse, Status>> + Send + 'static {
    futures_util::stream::unfold(conversation, |mut c| async move {
        loop {
            if let Some(next) = c.outbox.pop_front() {
                return Some((Ok(next), c));
            }
            let exchange = c.exchange.as_mut()?;
            match c.inbound.message().await {
                Ok(Some(message)) => {
                    let replies = exchange.handle(message).await;
                    c.outbox.extend(replies);
                }
                Ok(None) => {
                    if let Some(exchange) = c.exchange.take() {
                        exchange.close(true);
                    }
                    return None;
                }
                Err(e) => {
                    tracing::debug!("ext_proc stream cut: {e}");
                    if let Some(exchange) = c.exchange.take() {
                        exchange.close(false);
                    }
                    return None;
                }
            }
        }
    })
}

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let conversation = Conversation {
            inbound: request.into_inner(),
            exchange: Some(Exchange::new(self.gw.clone(), self.bodies)),
            outbox: VecDeque::new(),
        };
        Ok(Response::new(Box::pin(answers(conversation))))
    }
}

//! The gRPC service Envoy calls: `envoy.service.ext_proc.v3.ExternalProcessor/Process`, one
//! bidirectional stream per HTTP request, each driven by an [`Exchange`].

use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use switchyard_gateway::Gateway;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::exchange::{BodyWatch, Exchange};

/// Messages buffered towards Envoy per stream (response chunks wait here when Envoy is slow).
const OUTBOX: usize = 16;

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

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(OUTBOX);
        let mut exchange = Exchange::new(self.gw.clone(), self.bodies);
        tokio::spawn(async move {
            loop {
                let message = match inbound.message().await {
                    Ok(Some(m)) => m,
                    Ok(None) => {
                        exchange.close(true);
                        return;
                    }
                    Err(e) => {
                        tracing::debug!("ext_proc stream cut: {e}");
                        exchange.close(false);
                        return;
                    }
                };
                for reply in exchange.handle(message).await {
                    if tx.send(Ok(reply)).await.is_err() {
                        // Envoy went away: the client's request is over.
                        exchange.close(false);
                        return;
                    }
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

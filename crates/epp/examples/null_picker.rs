//! A do-nothing ext_proc server for `bench/epp.sh`: it speaks the same messages as
//! `switchyard epp` (the request body buffered and sent back with the destination, response
//! headers and bodies passed on unchanged) but parses nothing and routes round robin, so
//! Envoy + this against Envoy round robin measures Envoy's ext_proc machinery and the gRPC
//! round trips alone; `switchyard epp` minus this is the picker's own work.
//!
//! ```text
//! cargo run --release -p switchyard-epp --example null_picker -- --backend HOST:PORT...
//! ```
//!
//! Listens on 127.0.0.1 (a free port) and prints `listening on http://ADDR grpc=ADDR`.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures_util::Stream;
use switchyard_epp::messages;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};

/// Round robin over the backends; every answer is the protocol's minimum.
struct Null {
    backends: Arc<Vec<String>>,
    /// `request_body_mode: BUFFERED`: the body comes whole and is answered with the route only.
    buffered: bool,
    next: Arc<AtomicUsize>,
}

/// The answers to one ext_proc message (the body so far is kept in `body`).
fn answer(
    message: ProcessingRequest,
    body: &mut Vec<u8>,
    buffered: bool,
    pick: &dyn Fn() -> String,
) -> Vec<ProcessingResponse> {
    if buffered {
        return match message.request {
            Some(Message::RequestHeaders(h)) if h.end_of_stream => {
                vec![messages::routed(&pick(), &[])]
            }
            Some(Message::RequestHeaders(_)) => vec![messages::request_headers_unchanged()],
            Some(Message::RequestBody(_)) => vec![messages::routed_buffered(&pick(), &[])],
            // The response side, if sent at all, comes in observability mode: no answers.
            _ => Vec::new(),
        };
    }
    match message.request {
        Some(Message::RequestBody(b)) => {
            body.extend_from_slice(&b.body);
            if !b.end_of_stream {
                return Vec::new();
            }
            let mut out = vec![messages::routed(&pick(), &[])];
            out.extend(messages::request_body(body, true));
            out
        }
        Some(Message::RequestTrailers(_)) => vec![messages::trailers(true)],
        Some(Message::ResponseHeaders(_)) => vec![messages::response_headers_unchanged()],
        Some(Message::ResponseBody(b)) => vec![messages::response_body(&b.body, b.end_of_stream)],
        Some(Message::ResponseTrailers(_)) => vec![messages::trailers(false)],
        // A request without a body is routed at its headers.
        Some(Message::RequestHeaders(h)) if h.end_of_stream => vec![messages::routed(&pick(), &[])],
        // Otherwise the headers are answered with the body (full-duplex mode), as the picker does.
        Some(Message::RequestHeaders(_)) | None => Vec::new(),
    }
}

/// Whether this is the response's last message: an observer's stream (observability mode) ends
/// there, or Envoy holds it open for its `deferred_close_timeout`.
fn ends_response(message: &ProcessingRequest) -> bool {
    match &message.request {
        Some(Message::ResponseBody(b)) => b.end_of_stream,
        Some(Message::ResponseHeaders(h)) => h.end_of_stream,
        _ => false,
    }
}

#[tonic::async_trait]
impl ExternalProcessor for Null {
    type ProcessStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let (backends, next, buffered) = (self.backends.clone(), self.next.clone(), self.buffered);
        let state = (
            request.into_inner(),
            Vec::new(),
            Vec::<ProcessingResponse>::new(),
        );
        let stream =
            futures_util::stream::unfold(state, move |(mut inbound, mut body, mut outbox)| {
                let (backends, next) = (backends.clone(), next.clone());
                async move {
                    loop {
                        if !outbox.is_empty() {
                            let first = outbox.remove(0);
                            return Some((Ok(first), (inbound, body, outbox)));
                        }
                        let message = inbound.message().await.ok()??;
                        if buffered && ends_response(&message) {
                            return None;
                        }
                        let pick = || {
                            backends[next.fetch_add(1, Ordering::Relaxed) % backends.len()].clone()
                        };
                        outbox = answer(message, &mut body, buffered, &pick);
                    }
                }
            });
        Ok(Response::new(Box::pin(stream)))
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut backends = Vec::new();
    let mut buffered = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--buffered" {
            buffered = true;
            continue;
        }
        match (a.as_str(), args.next()) {
            ("--backend", Some(b)) => backends.push(b.trim_start_matches("http://").to_string()),
            _ => return Err("usage: null_picker [--buffered] --backend HOST:PORT...".into()),
        }
    }
    if backends.is_empty() {
        return Err("usage: null_picker --backend HOST:PORT...".into());
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    println!("listening on http://{addr} grpc={addr}");
    let service = Null {
        backends: Arc::new(backends),
        buffered,
        next: Arc::new(AtomicUsize::new(0)),
    };
    tonic::transport::Server::builder()
        .add_service(ExternalProcessorServer::new(service).max_decoding_message_size(64 << 20))
        .serve_with_incoming(TcpIncoming::from(listener).with_nodelay(Some(true)))
        .await?;
    Ok(())
}

//! The ext_proc messages the picker sends, built in one place: the routing answer (destination
//! header, `envoy.lb` metadata, cleared route cache), body chunks passed back in
//! `FULL_DUPLEX_STREAMED` mode, and immediate answers in OpenAI's error shape.

use std::collections::BTreeMap;

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use switchyard_gateway::error::ApiError;

/// The header (and `envoy.lb` metadata key) naming the picked endpoints, `ip:port[,ip:port…]`.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// Metadata namespace of the destination.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// Metadata namespace of the proxy's subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Key of the subset hint: the endpoints the proxy allows for this request.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The endpoint that served the request, in the response headers when the proxy adds it
/// (`%UPSTREAM_HOST%`): after a fallback it differs from the first endpoint named.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// The prefill endpoint of a disaggregated request, for the decode pod's sidecar (llm-d).
pub const PREFILLER: &str = "x-prefiller-host-port";

/// Largest body chunk sent back in one message (gRPC's default message limit is 4 MiB).
pub const MAX_CHUNK: usize = 1 << 20;

fn header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            // Envoy reads `raw_value` in ext_proc mutations.
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

fn string(value: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(value.to_string())),
    }
}

/// The answer to the request headers once the request is routed: the destination list in the
/// header and in `envoy.lb` metadata, `extra` headers set, the route cache cleared (the
/// destination changes the route).
pub fn routed(destination: &str, extra: &[(&str, String)]) -> ProcessingResponse {
    routed_with(destination, extra, |common| {
        Response::RequestHeaders(HeadersResponse {
            response: Some(common),
        })
    })
}

/// The answer to a buffered request body (`request_body_mode: BUFFERED`) once the request is
/// routed: as [`routed`], the destination set on the request headers Envoy still holds, and the
/// body left as it came (not sent back).
pub fn routed_buffered(destination: &str, extra: &[(&str, String)]) -> ProcessingResponse {
    routed_with(destination, extra, |common| {
        Response::RequestBody(BodyResponse {
            response: Some(common),
        })
    })
}

fn routed_with(
    destination: &str,
    extra: &[(&str, String)],
    answer: impl FnOnce(CommonResponse) -> Response,
) -> ProcessingResponse {
    let mut set_headers = vec![header(DESTINATION, destination)];
    set_headers.extend(extra.iter().map(|(k, v)| header(k, v)));
    let lb = Struct {
        fields: [(DESTINATION.to_string(), string(destination))].into(),
    };
    ProcessingResponse {
        response: Some(answer(CommonResponse {
            header_mutation: Some(HeaderMutation {
                set_headers,
                remove_headers: Vec::new(),
            }),
            clear_route_cache: true,
            ..Default::default()
        })),
        dynamic_metadata: Some(Struct {
            fields: [(
                LB_NAMESPACE.to_string(),
                Value {
                    kind: Some(Kind::StructValue(lb)),
                },
            )]
            .into(),
        }),
        ..Default::default()
    }
}

fn streamed(body: &[u8], end_of_stream: bool) -> CommonResponse {
    CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                body: body.to_vec(),
                end_of_stream,
                ..Default::default()
            })),
        }),
        ..Default::default()
    }
}

/// The request body passed on (in chunks of at most [`MAX_CHUNK`]).
pub fn request_body(body: &[u8], end_of_stream: bool) -> Vec<ProcessingResponse> {
    chunks(body)
        .map(|(chunk, last)| ProcessingResponse {
            response: Some(Response::RequestBody(BodyResponse {
                response: Some(streamed(chunk, end_of_stream && last)),
            })),
            ..Default::default()
        })
        .collect()
}

/// A response body chunk passed on.
pub fn response_body(body: &[u8], end_of_stream: bool) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseBody(BodyResponse {
            response: Some(streamed(body, end_of_stream)),
        })),
        ..Default::default()
    }
}

/// `body` in pieces of at most [`MAX_CHUNK`] (one empty piece for an empty body), each with
/// whether it is the last.
fn chunks(body: &[u8]) -> impl Iterator<Item = (&[u8], bool)> {
    let n = body.len().div_ceil(MAX_CHUNK).max(1);
    (0..n).map(move |i| {
        let start = i * MAX_CHUNK;
        let end = (start + MAX_CHUNK).min(body.len());
        (&body[start.min(body.len())..end], i + 1 == n)
    })
}

/// Headers passed on unchanged.
pub fn request_headers_unchanged() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse::default())),
        ..Default::default()
    }
}

/// Response headers passed on unchanged.
pub fn response_headers_unchanged() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseHeaders(HeadersResponse::default())),
        ..Default::default()
    }
}

/// Trailers passed on unchanged.
pub fn trailers(request: bool) -> ProcessingResponse {
    let t = TrailersResponse::default();
    ProcessingResponse {
        response: Some(if request {
            Response::RequestTrailers(t)
        } else {
            Response::ResponseTrailers(t)
        }),
        ..Default::default()
    }
}

/// An answer to the client in place of the engine's.
pub fn immediate(
    status: u16,
    body: Vec<u8>,
    extra: &[(&str, String)],
    details: &str,
) -> ProcessingResponse {
    let mut set_headers = vec![header("content-type", "application/json")];
    set_headers.extend(extra.iter().map(|(k, v)| header(k, v)));
    ProcessingResponse {
        response: Some(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(status),
            }),
            headers: Some(HeaderMutation {
                set_headers,
                remove_headers: Vec::new(),
            }),
            body,
            details: details.to_string(),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// An error answered in OpenAI's shape (with `Retry-After` when it has one).
pub fn error(e: &ApiError) -> ProcessingResponse {
    let retry: Vec<(&str, String)> = e
        .retry_after
        .map(|s| ("retry-after", s.to_string()))
        .into_iter()
        .collect();
    immediate(e.status.as_u16(), e.body(), &retry, e.code)
}

/// The endpoints the proxy allows for this request (its subset hint), if it gave any.
pub fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<String>> {
    let hint = metadata?.filter_metadata.get(SUBSET_NAMESPACE)?;
    let value = hint.fields.get(SUBSET_KEY)?;
    let mut out = Vec::new();
    match value.kind.as_ref()? {
        Kind::ListValue(list) => {
            for v in &list.values {
                if let Some(Kind::StringValue(s)) = &v.kind {
                    out.push(s.trim().to_string());
                }
            }
        }
        Kind::StringValue(s) => out.extend(s.split(',').map(|p| p.trim().to_string())),
        _ => return None,
    }
    out.retain(|s| !s.is_empty());
    Some(out)
}

/// The value of header `name` (lower-case) in request or response headers, as [`header_map`]
/// has it (the last of repeated ones), without building the whole map: the picker reads four
/// headers of a request and three of a response, and the map cost two allocations a header.
pub fn header_value(
    headers: Option<&envoy_types::pb::envoy::config::core::v3::HeaderMap>,
    name: &str,
) -> Option<String> {
    let h = headers?
        .headers
        .iter()
        .rev()
        .find(|h| h.key.eq_ignore_ascii_case(name))?;
    Some(if h.raw_value.is_empty() {
        h.value.clone()
    } else {
        String::from_utf8_lossy(&h.raw_value).into_owned()
    })
}

/// Request or response headers as a name → value map (lower-case names; `raw_value` or
/// `value`, whichever the proxy filled).
pub fn header_map(
    headers: Option<&envoy_types::pb::envoy::config::core::v3::HeaderMap>,
) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for h in headers.map_or(&[][..], |h| &h.headers[..]) {
        let value = if h.raw_value.is_empty() {
            h.value.clone()
        } else {
            String::from_utf8_lossy(&h.raw_value).into_owned()
        };
        out.insert(h.key.to_ascii_lowercase(), value);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::ListValue;

    #[test]
    fn the_routing_answer_names_the_destination_twice() {
        let r = routed("10.0.0.1:8000,10.0.0.2:8000", &[]);
        let Some(Response::RequestHeaders(h)) = r.response else {
            panic!("a headers response")
        };
        let common = h.response.unwrap();
        assert!(common.clear_route_cache);
        let set = &common.header_mutation.unwrap().set_headers;
        let first = set[0].header.as_ref().unwrap();
        assert_eq!(first.key, DESTINATION);
        assert_eq!(first.raw_value, b"10.0.0.1:8000,10.0.0.2:8000");
        let lb = &r.dynamic_metadata.unwrap().fields[LB_NAMESPACE];
        let Some(Kind::StructValue(lb)) = &lb.kind else {
            panic!("a struct")
        };
        assert_eq!(
            lb.fields[DESTINATION].kind,
            Some(Kind::StringValue("10.0.0.1:8000,10.0.0.2:8000".into()))
        );
    }

    #[test]
    fn the_buffered_answer_routes_without_sending_the_body_back() {
        let r = routed_buffered("10.0.0.1:8000", &[("x-extra", "1".to_string())]);
        let Some(Response::RequestBody(b)) = r.response else {
            panic!("a body response")
        };
        let common = b.response.unwrap();
        assert!(common.clear_route_cache);
        assert!(common.body_mutation.is_none());
        let set = &common.header_mutation.unwrap().set_headers;
        let keys: Vec<_> = set
            .iter()
            .map(|h| h.header.as_ref().unwrap().key.as_str())
            .collect();
        assert_eq!(keys, [DESTINATION, "x-extra"]);
        assert!(r
            .dynamic_metadata
            .unwrap()
            .fields
            .contains_key(LB_NAMESPACE));
    }

    #[test]
    fn one_header_reads_as_the_map_has_it() {
        use envoy_types::pb::envoy::config::core::v3::HeaderMap as Headers;
        let h = |key: &str, value: &str, raw: &[u8]| HeaderValue {
            key: key.to_string(),
            value: value.to_string(),
            raw_value: raw.to_vec(),
        };
        let headers = Headers {
            headers: vec![
                h(":path", "", b"/v1/chat/completions"),
                h("X-Session-Id", "a", b""),
                h("x-session-id", "", b"b"),
                h("content-type", "text/event-stream", b""),
                h("bad", "", b"\xff"),
            ],
        };
        let map = header_map(Some(&headers));
        for name in [":path", "x-session-id", "content-type", "bad", "absent"] {
            assert_eq!(
                header_value(Some(&headers), name).as_ref(),
                map.get(name),
                "{name}"
            );
        }
        assert_eq!(header_value(None, ":path"), None);
    }

    #[test]
    fn bodies_are_cut_below_the_grpc_limit() {
        let body = vec![b'x'; MAX_CHUNK * 2 + 5];
        let parts = request_body(&body, true);
        assert_eq!(parts.len(), 3);
        let mut total = 0;
        for (i, p) in parts.iter().enumerate() {
            let Some(Response::RequestBody(b)) = &p.response else {
                panic!("a body response")
            };
            let Some(Mutation::StreamedResponse(s)) = b
                .response
                .as_ref()
                .and_then(|c| c.body_mutation.as_ref())
                .and_then(|m| m.mutation.as_ref())
            else {
                panic!("a streamed body")
            };
            total += s.body.len();
            assert_eq!(s.end_of_stream, i == 2);
        }
        assert_eq!(total, body.len());
        assert_eq!(request_body(b"", true).len(), 1);
    }

    #[test]
    fn the_subset_hint_is_read_as_a_list_or_a_string() {
        let meta = |value: Value| Metadata {
            filter_metadata: [(
                SUBSET_NAMESPACE.to_string(),
                Struct {
                    fields: [(SUBSET_KEY.to_string(), value)].into(),
                },
            )]
            .into(),
            ..Default::default()
        };
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![string("10.0.0.1:8000"), string("10.0.0.2:8000")],
            })),
        };
        assert_eq!(
            subset_hint(Some(&meta(list))),
            Some(vec!["10.0.0.1:8000".into(), "10.0.0.2:8000".into()])
        );
        assert_eq!(
            subset_hint(Some(&meta(string("a:1, b:2")))),
            Some(vec!["a:1".into(), "b:2".into()])
        );
        assert_eq!(subset_hint(None), None);
    }
}

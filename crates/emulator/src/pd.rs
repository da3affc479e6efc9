//! Prefill/decode disaggregation on the wire.
//!
//! **vLLM (NixlConnector).** A request whose `kv_transfer_params` has
//! `do_remote_decode: true` is only prefilled ([`RequestMode::PrefillOnly`]);
//! its response carries the parameters the decode instance needs:
//! `do_remote_prefill: true`, `do_remote_decode: false`, `remote_block_ids`,
//! `remote_engine_id`, `remote_request_id`, `remote_host`, `remote_port`,
//! `tp_size`. A request carrying those with `do_remote_prefill: true` is
//! decoded after paying the modelled KV-transfer time instead of prefill
//! ([`RequestMode::DecodeAfterTransfer`]). In the emulator `remote_host` /
//! `remote_port` are the prefill emulator's own HTTP address (real vLLM sends
//! its NIXL side-channel address); nothing connects to them.
//!
//! **SGLang.** The router sends the same body to a prefill and a decode
//! server at once, with `bootstrap_host`, `bootstrap_port` and
//! `bootstrap_room` added. The emulator keeps that simple: a prefill-role
//! instance prefills (and its answer is ignored by the router), a
//! decode-role instance treats the request as transferred from
//! `bootstrap_host:bootstrap_port` and pays the transfer time for the whole
//! prompt; no bootstrap server is contacted or served, so the two halves are
//! not synchronised (decode does not wait for the real prefill to finish).
//!
//! **Roles.** A decode-role instance serves an ordinary request (no
//! `kv_transfer_params`, no bootstrap fields) whole, prefill included, as a
//! vLLM decode instance does: a router that keeps short or mostly cached
//! prompts on a decode instance (selective disaggregation) relies on it (the
//! engine model's decode role accepts [`RequestMode::Normal`]). Everything else a role
//! cannot serve is refused by the engine with 400 (`a prefill instance does
//! not accept normal requests`, `a decode instance does not accept
//! prefill-only requests`, ...): a prefill-only instance takes only prefill
//! legs (`do_remote_decode`, or bootstrap fields), a decode-only instance
//! never a prefill leg. Tests rely on that refusal to prove that a router
//! never sends a leg to an instance of the wrong role.

use serde_json::{json, Value};
use switchyard_engine::{KvTransfer, RequestMode, Role};

use crate::error::ApiError;

/// What the PD fields of a request ask for.
#[derive(Debug, Clone, PartialEq)]
pub enum PdIntent {
    /// An ordinary request.
    None,
    /// vLLM prefill leg (`do_remote_decode: true`).
    VllmPrefill,
    /// vLLM decode leg (`do_remote_prefill: true`) with the hand-off.
    VllmDecode(KvTransferIn),
    /// SGLang request with bootstrap fields.
    Sglang {
        /// `host:port` of the prefill bootstrap server.
        source: String,
        /// The room id pairing both legs.
        room: String,
    },
}

/// The hand-off fields a decode instance receives.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct KvTransferIn {
    /// Engine id of the prefill instance.
    pub remote_engine_id: String,
    /// Block ids holding the prompt's KV on the prefill instance.
    pub remote_block_ids: Vec<u32>,
    /// Request id on the prefill instance.
    pub remote_request_id: String,
}

fn value_to_string(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// Read the PD intent from a request's fields.
pub fn parse_intent(
    kv_transfer_params: Option<&Value>,
    bootstrap_host: Option<&Value>,
    bootstrap_port: Option<&Value>,
    bootstrap_room: Option<&Value>,
) -> Result<PdIntent, ApiError> {
    if let Some(p) = kv_transfer_params {
        if p.is_null() {
            // vLLM treats an explicit null as absent.
        } else if let Some(obj) = p.as_object() {
            let flag = |k: &str| obj.get(k).and_then(Value::as_bool).unwrap_or(false);
            if flag("do_remote_decode") && flag("do_remote_prefill") {
                return Err(ApiError::bad_request(
                    "kv_transfer_params cannot set both do_remote_decode and do_remote_prefill",
                )
                .with_param("kv_transfer_params"));
            }
            if flag("do_remote_decode") {
                return Ok(PdIntent::VllmPrefill);
            }
            if flag("do_remote_prefill") {
                let blocks = match obj.get("remote_block_ids") {
                    Some(Value::Array(a)) => a
                        .iter()
                        .map(|b| {
                            b.as_u64()
                                .and_then(|x| u32::try_from(x).ok())
                                .ok_or_else(|| {
                                    ApiError::bad_request(
                                        "remote_block_ids must be a list of block ids",
                                    )
                                    .with_param("kv_transfer_params")
                                })
                        })
                        .collect::<Result<Vec<u32>, ApiError>>()?,
                    Some(Value::Null) | None => Vec::new(),
                    Some(_) => {
                        return Err(ApiError::bad_request(
                            "remote_block_ids must be a list of block ids",
                        )
                        .with_param("kv_transfer_params"))
                    }
                };
                return Ok(PdIntent::VllmDecode(KvTransferIn {
                    remote_engine_id: obj
                        .get("remote_engine_id")
                        .map(value_to_string)
                        .unwrap_or_default(),
                    remote_block_ids: blocks,
                    remote_request_id: obj
                        .get("remote_request_id")
                        .map(value_to_string)
                        .unwrap_or_default(),
                }));
            }
        } else {
            return Err(
                ApiError::bad_request("kv_transfer_params must be an object")
                    .with_param("kv_transfer_params"),
            );
        }
    }
    if let Some(room) = bootstrap_room.filter(|v| !v.is_null()) {
        let host = bootstrap_host.map(value_to_string).unwrap_or_default();
        let port = bootstrap_port.map(value_to_string).unwrap_or_default();
        return Ok(PdIntent::Sglang {
            source: format!("{host}:{port}"),
            room: value_to_string(room),
        });
    }
    Ok(PdIntent::None)
}

/// Choose the engine mode for an intent on an instance of `role`.
pub fn request_mode(
    intent: &PdIntent,
    role: Role,
    prompt_tokens: u32,
    block_size: u32,
) -> RequestMode {
    match intent {
        PdIntent::None => RequestMode::Normal,
        PdIntent::VllmPrefill => RequestMode::PrefillOnly,
        PdIntent::VllmDecode(k) => RequestMode::DecodeAfterTransfer(KvTransfer {
            remote_engine_id: k.remote_engine_id.clone(),
            remote_block_ids: k.remote_block_ids.clone(),
            remote_request_id: k.remote_request_id.clone(),
            num_tokens: prompt_tokens,
        }),
        PdIntent::Sglang { source, room } => match role {
            Role::Prefill => RequestMode::PrefillOnly,
            Role::Decode => RequestMode::DecodeAfterTransfer(KvTransfer {
                remote_engine_id: source.clone(),
                remote_block_ids: (0..prompt_tokens.div_ceil(block_size.max(1))).collect(),
                remote_request_id: room.clone(),
                num_tokens: prompt_tokens,
            }),
            Role::Both => RequestMode::Normal,
        },
    }
}

/// Where the prefill instance says the KV lives.
#[derive(Debug, Clone, PartialEq)]
pub struct Advertised {
    /// Host to put in `remote_host`.
    pub host: String,
    /// Port to put in `remote_port`.
    pub port: u16,
}

/// The `kv_transfer_params` a prefill response carries.
pub fn prefill_response_params(kv: &KvTransfer, at: &Advertised) -> Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": kv.remote_block_ids,
        "remote_engine_id": kv.remote_engine_id,
        "remote_request_id": kv.remote_request_id,
        "remote_host": at.host,
        "remote_port": at.port,
        "tp_size": 1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_intent() {
        let p = json!({"do_remote_decode": true, "do_remote_prefill": false,
                       "remote_engine_id": null, "remote_block_ids": null,
                       "remote_host": null, "remote_port": null});
        assert_eq!(
            parse_intent(Some(&p), None, None, None).unwrap(),
            PdIntent::VllmPrefill
        );
    }

    #[test]
    fn decode_intent_round_trip() {
        let kv = KvTransfer {
            remote_engine_id: "e1".into(),
            remote_block_ids: vec![3, 4],
            remote_request_id: "r1".into(),
            num_tokens: 20,
        };
        let at = Advertised {
            host: "127.0.0.1".into(),
            port: 8000,
        };
        let params = prefill_response_params(&kv, &at);
        assert_eq!(params["do_remote_prefill"], true);
        assert_eq!(params["tp_size"], 1);
        let intent = parse_intent(Some(&params), None, None, None).unwrap();
        match request_mode(&intent, Role::Decode, 20, 16) {
            RequestMode::DecodeAfterTransfer(k) => {
                assert_eq!(k.remote_engine_id, "e1");
                assert_eq!(k.remote_block_ids, vec![3, 4]);
                assert_eq!(k.remote_request_id, "r1");
                assert_eq!(k.num_tokens, 20);
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn bad_params_are_400() {
        let e = parse_intent(Some(&json!("x")), None, None, None).unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        let e = parse_intent(
            Some(&json!({"do_remote_prefill": true, "remote_block_ids": "no"})),
            None,
            None,
            None,
        )
        .unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
    }

    #[test]
    fn a_plain_request_is_a_normal_one_on_every_role() {
        for role in [Role::Both, Role::Prefill, Role::Decode] {
            assert_eq!(
                request_mode(&PdIntent::None, role, 40, 16),
                RequestMode::Normal
            );
        }
    }

    #[test]
    fn sglang_bootstrap() {
        let intent = parse_intent(
            None,
            Some(&json!("10.0.0.1")),
            Some(&json!(8998)),
            Some(&json!(42)),
        )
        .unwrap();
        assert_eq!(
            intent,
            PdIntent::Sglang {
                source: "10.0.0.1:8998".into(),
                room: "42".into()
            }
        );
        assert!(matches!(
            request_mode(&intent, Role::Prefill, 10, 16),
            RequestMode::PrefillOnly
        ));
        match request_mode(&intent, Role::Decode, 33, 16) {
            RequestMode::DecodeAfterTransfer(k) => assert_eq!(k.remote_block_ids.len(), 3),
            other => panic!("unexpected {other:?}"),
        }
    }
}

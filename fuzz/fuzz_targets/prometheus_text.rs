//! The engines' Prometheus text as the scraper reads it: any text, any engine kind, no panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use switchyard_gateway::promtext::samples;
use switchyard_gateway::scrape::{detect, engine_metrics};
use switchyard_gateway::EngineKind;

fuzz_target!(|text: &str| {
    for sample in samples(text) {
        let _ = sample.label("model_name");
    }
    let _ = detect(text);
    for kind in ["auto", "vllm", "sglang", "llamacpp", "trtllm"] {
        let kind: EngineKind = kind.parse().expect("a kind name");
        if let (_, Some(m)) = engine_metrics(text, kind) {
            if let Some(u) = m.kv_usage {
                assert!(u.is_finite(), "kv usage {u} from {text:?}");
            }
        }
    }
});

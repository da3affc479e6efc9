//! The request body parser: never panics, and its fast scanner agrees with serde wherever the
//! scanner answers (a body it mis-read would be routed on a wrong model or prompt).
#![no_main]

use libfuzzer_sys::fuzz_target;
use switchyard_gateway::parse::{parse, parse_both_paths};

fuzz_target!(|body: &[u8]| {
    let _ = parse(body, None);
    let (fast, serde) = parse_both_paths(body, Some("session"));
    if let Some(fast) = fast {
        match serde {
            Ok(serde) => assert_eq!(fast, serde, "the two paths disagree"),
            Err(e) => panic!("the fast path accepted a body serde refuses: {e}"),
        }
    }
});

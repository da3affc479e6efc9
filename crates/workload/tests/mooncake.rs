//! The Mooncake conversation trace shipped in `data/traces/`.

use std::collections::HashSet;
use std::sync::Arc;

use switchyard_workload::{
    read_trace, shipped_mooncake_trace, Prompt, Request, TraceSpec, WorkloadSpec,
    MOONCAKE_BLOCK_TOKENS,
};

#[test]
fn shipped_trace_matches_its_readme() {
    let rows = read_trace(&shipped_mooncake_trace(), MOONCAKE_BLOCK_TOKENS).unwrap();
    assert_eq!(rows.len(), 12_031);
    // read_trace already enforces len(hash_ids) == ceil(input_length / 512);
    // check it here too, independently, since the README promises it.
    for r in &rows {
        assert_eq!(r.hash_ids.len(), r.input_length.div_ceil(512) as usize);
    }
    let minutes = rows.last().unwrap().timestamp / 60_000.0;
    assert!((58.8..59.0).contains(&minutes), "{minutes}");
    assert!(
        rows.iter().all(|r| r.hash_ids[0] == 0),
        "block 0 is in every request"
    );
    // "With an unlimited cache, 36.6% of all blocks were seen before."
    let mut seen = HashSet::new();
    let (mut total, mut hits) = (0u64, 0u64);
    for r in &rows {
        for id in &r.hash_ids {
            total += 1;
            hits += u64::from(!seen.insert(*id));
        }
    }
    let reuse = hits as f64 / total as f64;
    assert!((reuse - 0.366).abs() < 0.001, "{reuse}");
}

#[test]
fn replays_first_100_rows_exactly() {
    let rows = read_trace(&shipped_mooncake_trace(), MOONCAKE_BLOCK_TOKENS).unwrap();
    let spec = WorkloadSpec::Trace(TraceSpec {
        max_requests: Some(100),
        ..Default::default()
    });
    let reqs: Vec<Request> = spec.build(0).unwrap().collect();
    assert_eq!(reqs.len(), 100);
    for (r, row) in reqs.iter().zip(&rows) {
        assert_eq!(r.prompt_tokens(), row.input_length as usize);
        assert_eq!(r.prompt.render().len(), 4 * row.input_length as usize);
        assert_eq!(r.max_tokens, row.output_length);
        assert_eq!(r.arrival_s, row.timestamp / 1000.0);
        let Prompt::Text(segs) = &r.prompt else {
            panic!("trace prompts are text")
        };
        assert_eq!(segs.len(), row.hash_ids.len());
    }
    // Rows 0 and 1 share block 0 and nothing after it.
    let (a, b) = (reqs[0].prompt.render(), reqs[1].prompt.render());
    assert_eq!(a[..2048], b[..2048]);
    assert_ne!(a[2048..2100], b[2048..2100]);
    let first = |r: &Request| match &r.prompt {
        Prompt::Text(s) => s[0].clone(),
        Prompt::Chat(_) => unreachable!(),
    };
    assert!(reqs
        .iter()
        .all(|r| Arc::ptr_eq(&first(r), &first(&reqs[0]))));
}

#[test]
fn plain_and_xz_read_the_same() {
    let dir = std::env::temp_dir().join(format!("sy-wl-moon-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plain = dir.join("trace.jsonl");
    let mut text = String::new();
    std::io::Read::read_to_string(
        &mut switchyard_workload::source::open_lines(&shipped_mooncake_trace()).unwrap(),
        &mut text,
    )
    .unwrap();
    std::fs::write(&plain, text).unwrap();
    let a = read_trace(&plain, 512).unwrap();
    let b = read_trace(&shipped_mooncake_trace(), 512).unwrap();
    assert_eq!(a, b);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn rate_scale_and_window() {
    let spec = TraceSpec {
        start_s: Some(600.0),
        end_s: Some(1200.0),
        rate_scale: 4.0,
        ..Default::default()
    };
    let reqs: Vec<Request> = spec.build(0).unwrap().collect();
    assert!(reqs.len() > 1000, "{}", reqs.len());
    let last = reqs.last().unwrap().arrival_s;
    // Ten minutes of trace compressed 4x: under 150 s.
    assert!(last < 150.0 && last > 140.0, "{last}");
    assert!(reqs.windows(2).all(|w| w[0].arrival_s <= w[1].arrival_s));
}

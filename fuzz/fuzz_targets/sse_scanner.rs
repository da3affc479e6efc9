//! The SSE scanner: any split of a stream into chunks gives the same output, usage and end.
#![no_main]

use arbitrary::Arbitrary;
use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use switchyard_gateway::stream::SseScanner;

#[derive(Debug, Arbitrary)]
struct Input {
    stream: Vec<u8>,
    /// Chunk lengths, cycled.
    splits: Vec<u8>,
    strip_usage: bool,
}

fn scan(stream: &[u8], splits: &[u8], strip_usage: bool) -> (Vec<u8>, SseScanner) {
    let mut scanner = SseScanner::new(strip_usage);
    let mut out = Vec::new();
    let mut rest = stream;
    let mut i = 0;
    while !rest.is_empty() {
        let len = match splits.get(i % splits.len().max(1)) {
            Some(&n) => usize::from(n).max(1),
            None => rest.len(),
        };
        let (chunk, tail) = rest.split_at(len.min(rest.len()));
        out.extend_from_slice(&scanner.feed(Bytes::copy_from_slice(chunk)));
        rest = tail;
        i += 1;
    }
    out.extend_from_slice(&scanner.finish());
    (out, scanner)
}

fuzz_target!(|input: Input| {
    let (whole, a) = scan(&input.stream, &[], input.strip_usage);
    let (split, b) = scan(&input.stream, &input.splits, input.strip_usage);
    assert_eq!(whole, split, "output depends on the chunking");
    assert_eq!(a.usage, b.usage, "usage depends on the chunking");
    assert_eq!(a.done, b.done, "the end depends on the chunking");
    if !input.strip_usage {
        assert_eq!(whole, input.stream, "a watched stream passes unchanged");
    }
});

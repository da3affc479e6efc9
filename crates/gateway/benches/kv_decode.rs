//! Cost of the exact index's inputs: decoding one KV event batch as vLLM publishes it
//! (`kv_events::wire`), per layout (one engine step's `BlockStored` of 16 blocks of 16 tokens
//! plus a `BlockRemoved` of 16 blocks), and tokenizing prompts of 1k, 2k and 32k tokens with
//! the emulator's tokenizer.json (`tokenize`): the tokenizers crate alone, a prompt seen for
//! the first time and again, and chat conversations, whole and turn after turn; and tokenized
//! only as far as exact matching needs (`ids_as_needed`: nothing or half of a new prompt held,
//! a conversation's next turn whose history is held).

use criterion::{criterion_group, criterion_main, Criterion};
use switchyard_emulator::kv_events::{encode_batch, Format, WireEvent};
use switchyard_engine::KvEvent;
use switchyard_gateway::kv_events::wire::decode_message;

fn batches(c: &mut Criterion) {
    let stored = KvEvent::BlockStored {
        block_hashes: (0..16)
            .map(|i| 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i + 1))
            .collect(),
        parent_block_hash: Some(7),
        token_ids: (0..256).map(|t| 1000 + t * 37).collect(),
        block_size: 16,
        lora_name: None,
    };
    let removed = KvEvent::BlockRemoved {
        block_hashes: (100..116).collect(),
    };
    let wire = [
        WireEvent {
            event: &stored,
            lora_id: None,
        },
        WireEvent {
            event: &removed,
            lora_id: None,
        },
    ];
    for format in [Format::Array, Format::Map] {
        let frames = [
            Vec::new(),
            41u64.to_be_bytes().to_vec(),
            encode_batch(1.7e9, &wire, 0, format),
        ];
        c.bench_function(
            &format!("decode_batch_{format:?}_{}B", frames[2].len()),
            |b| b.iter(|| decode_message(std::hint::black_box(&frames)).map(|b| b.events.len())),
        );
    }
}

/// Writes `tokenizer` and `config` to a directory and loads them with `cache_bytes` of piece
/// cache.
fn load(
    tokenizer: &str,
    config: &str,
    cache_bytes: usize,
) -> switchyard_gateway::tokenize::Tokenizers {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, tokenizer).unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), config).unwrap();
    let files = std::collections::BTreeMap::from([("m".to_string(), path)]);
    switchyard_gateway::tokenize::Tokenizers::load_with_cache(&files, cache_bytes).unwrap()
}

/// The emulator's tokenizer with ChatML's special tokens and template, as a chat model's
/// tokenizer has them: the template writes `<|im_start|>` and `<|im_end|>` around every
/// message, so each message is a piece of its own.
fn chatml() -> (String, String) {
    let mut json: serde_json::Value =
        serde_json::from_str(&switchyard_emulator::tokenizer_json::tokenizer_json()).unwrap();
    json["added_tokens"] = ["<|im_start|>", "<|im_end|>"]
        .iter()
        .enumerate()
        .map(|(i, content)| {
            serde_json::json!({"id": 1 + i, "content": content, "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    // The role written as the emulator's marker (`<|user|>\n`), which its vocabulary covers, so
    // that every rendered conversation tokenizes without an unknown token.
    let template = "{% for m in messages %}<|im_start|><|{{ m.role }}|>\n{{ m.content }}<|im_end|>\n\
                    {% endfor %}{% if add_generation_prompt %}<|im_start|><|assistant|>\n{% endif %}";
    let config = serde_json::json!({"chat_template": template}).to_string();
    (json.to_string(), config)
}

fn tokenize(c: &mut Criterion) {
    use switchyard_gateway::tokenize::{Input, Needed};
    let emulator = switchyard_emulator::tokenizer_json::tokenizer_json();
    let emulator_config = switchyard_emulator::tokenizer_json::tokenizer_config_json();
    let hf: tokenizers::Tokenizer = emulator.parse().unwrap();
    // No piece cache: every prompt costs what a first-seen one does.
    let uncached = load(&emulator, &emulator_config, 0);
    let cached = load(&emulator, &emulator_config, 64 << 20);
    let (chatml_json, chatml_config) = chatml();
    let chatml_uncached = load(&chatml_json, &chatml_config, 0);
    let chatml_cached = load(&chatml_json, &chatml_config, 64 << 20);
    let words: Vec<&str> = switchyard_engine::tokenizer::vocabulary()
        .map(|(w, _)| w)
        .collect();
    let text = |n: usize| -> String { (0..n).map(|i| words[(i * 7) % words.len()]).collect() };
    for n in [1000, 2000, 32_000] {
        let prompt = text(n);
        // The tokenizers crate alone: with offsets (`encode`) and without (`encode_fast`).
        c.bench_function(&format!("tokenize_{n}_tokens_hf_encode"), |b| {
            b.iter(|| {
                hf.encode(std::hint::black_box(prompt.as_str()), true)
                    .map(|e| e.len())
            })
        });
        c.bench_function(&format!("tokenize_{n}_tokens_hf_encode_fast"), |b| {
            b.iter(|| {
                hf.encode_fast(std::hint::black_box(prompt.as_str()), true)
                    .map(|e| e.len())
            })
        });
        c.bench_function(&format!("tokenize_{n}_tokens_first_seen"), |b| {
            b.iter(|| {
                uncached
                    .token_ids("m", std::hint::black_box(&prompt))
                    .map(|ids| ids.len())
            })
        });
        // Tokenized as far as exact matching needs (`ids_as_needed`), with a horizon as the
        // router gives it for 16-token blocks: nothing held, or the prompt's first half.
        let held_upto = |held: usize| move |ids: &[u32]| (ids.len().min(held) / 16 + 1) * 16;
        // The router's approximate index says where the held part ends (4 bytes a token
        // here), or nothing (another replica placed the conversation).
        for (label, held, hint) in [
            ("nothing_held", 0, 0),
            ("half_held", n / 2, 2 * n),
            ("half_held_no_hint", n / 2, 0),
        ] {
            c.bench_function(
                &format!("tokenize_{n}_tokens_first_seen_as_needed_{label}"),
                |b| {
                    b.iter(|| {
                        let input = Input::Text(std::hint::black_box(prompt.as_str()));
                        uncached
                            .ids_as_needed(
                                "m",
                                &input,
                                &mut held_upto(held),
                                hint,
                                usize::MAX,
                                &mut 0,
                            )
                            .map(|needed| matches!(needed, Needed::Whole(_)))
                    })
                },
            );
        }
        // A conversation sent as one text (`/v1/completions`): the last turn's text kept (it
        // was tokenized, or warmed as its answer ended), the next turn a sixth longer.
        let mut conversation = 0usize;
        c.bench_function(&format!("tokenize_{n}_tokens_next_turn_continued"), |b| {
            b.iter_batched(
                || {
                    conversation += 1;
                    let lead: String = (0..4)
                        .map(|digit| words[conversation / words.len().pow(digit) % words.len()])
                        .collect();
                    let history = format!("{lead}{}", text(n * 5 / 6));
                    cached
                        .token_ids("m", &history)
                        .expect("the history tokenizes");
                    format!("{history}{}", text(n / 6))
                },
                |next| {
                    let input = Input::Text(std::hint::black_box(next.as_str()));
                    cached
                        .ids_as_needed("m", &input, &mut |_| usize::MAX, 0, usize::MAX, &mut 0)
                        .map(|needed| matches!(needed, Needed::Whole(_)))
                },
                criterion::BatchSize::SmallInput,
            )
        });
        c.bench_function(&format!("tokenize_{n}_tokens_seen_before"), |b| {
            b.iter(|| {
                cached
                    .token_ids("m", std::hint::black_box(&prompt))
                    .map(|ids| ids.len())
            })
        });
        // The same tokens as a conversation: a system prompt and three turns, rendered with
        // the chat template first.
        let (system, turn) = (text(n / 2), text(n / 6));
        let messages = [
            ("system", system.as_str()),
            ("user", turn.as_str()),
            ("assistant", turn.as_str()),
            ("user", turn.as_str()),
        ];
        c.bench_function(&format!("tokenize_chat_{n}_tokens_first_seen"), |b| {
            b.iter(|| {
                uncached
                    .chat_token_ids("m", std::hint::black_box(&messages))
                    .map(|ids| ids.len())
            })
        });
        c.bench_function(&format!("tokenize_chatml_{n}_tokens_first_seen"), |b| {
            b.iter(|| {
                chatml_uncached
                    .chat_token_ids("m", std::hint::black_box(&messages))
                    .map(|ids| ids.len())
            })
        });
        // The next turn of a conversation: everything but the last message was sent before;
        // the last one is new every time (a counter spelled in words leads it).
        let mut turn_number = 0usize;
        c.bench_function(&format!("tokenize_chatml_{n}_tokens_next_turn"), |b| {
            b.iter_batched(
                || {
                    turn_number += 1;
                    let mut last: String = (0..4)
                        .map(|digit| words[turn_number / words.len().pow(digit) % words.len()])
                        .collect();
                    last.push_str(&turn);
                    last
                },
                |last| {
                    let conversation = [messages[0], messages[1], messages[2], ("user", &last)];
                    chatml_cached
                        .chat_token_ids("m", std::hint::black_box(&conversation))
                        .map(|ids| ids.len())
                },
                criterion::BatchSize::SmallInput,
            )
        });
        // The same next turn as far as exact matching needs: an instance holds every message
        // but the new one.
        let history = chatml_cached
            .chat_token_ids("m", &messages[..3])
            .map_or(0, |ids| ids.len());
        assert!(history > 0, "the bench's conversation must tokenize");
        c.bench_function(
            &format!("tokenize_chatml_{n}_tokens_next_turn_as_needed"),
            |b| {
                b.iter_batched(
                    || {
                        turn_number += 1;
                        let mut last: String = (0..4)
                            .map(|digit| words[turn_number / words.len().pow(digit) % words.len()])
                            .collect();
                        last.push_str(&turn);
                        last
                    },
                    |last| {
                        let conversation: Vec<(&str, &str)> =
                            vec![messages[0], messages[1], messages[2], ("user", &last)];
                        let input = Input::Chat(std::hint::black_box(conversation));
                        chatml_cached
                            .ids_as_needed(
                                "m",
                                &input,
                                &mut held_upto(history),
                                0,
                                usize::MAX,
                                &mut 0,
                            )
                            .map(|needed| matches!(needed, Needed::Whole(_)))
                    },
                    criterion::BatchSize::SmallInput,
                )
            },
        );
        // A next turn as it comes: the last answer is new to the piece cache too (an engine
        // generated it), and an instance holds the history up to it. Whole (as before), and
        // as far as exact matching needs.
        let words = &words;
        let chatml_uncached = &chatml_uncached;
        let turn = &turn;
        let mut spelled = || -> String {
            turn_number += 1;
            (0..4)
                .map(|digit| words[turn_number / words.len().pow(digit) % words.len()])
                .collect()
        };
        let mut fresh_turn = || {
            let answer = format!("{}{turn}", spelled());
            let last = format!("{}{turn}", spelled());
            let held = chatml_uncached
                .chat_token_ids(
                    "m",
                    &[messages[0], messages[1], ("assistant", answer.as_str())],
                )
                .map_or(0, |ids| ids.len());
            assert!(held > 0, "the bench's conversation must tokenize");
            (answer, last, held)
        };
        for as_needed in [false, true] {
            let label = if as_needed { "_as_needed" } else { "" };
            c.bench_function(
                &format!("tokenize_chatml_{n}_tokens_next_turn_new_answer{label}"),
                |b| {
                    b.iter_batched(
                        &mut fresh_turn,
                        |(answer, last, held)| {
                            let conversation: Vec<(&str, &str)> = vec![
                                messages[0],
                                messages[1],
                                ("assistant", &answer),
                                ("user", &last),
                            ];
                            let input = Input::Chat(std::hint::black_box(conversation));
                            if as_needed {
                                chatml_cached
                                    .ids_as_needed(
                                        "m",
                                        &input,
                                        &mut held_upto(held),
                                        0,
                                        usize::MAX,
                                        &mut 0,
                                    )
                                    .is_ok()
                            } else {
                                chatml_cached.ids("m", &input).is_ok()
                            }
                        },
                        criterion::BatchSize::SmallInput,
                    )
                },
            );
        }
        // The same next turn when the gateway warmed the piece cache with the last answer as
        // it ended (`Tokenizers::warm`, off the next turn's path, in the setup here), and what
        // that warming costs.
        let warm = |answer: &str| {
            let conversation = vec![messages[0], messages[1], ("assistant", answer)];
            chatml_cached
                .warm("m", &Input::Chat(conversation), false)
                .expect("the answer is in the rendering")
        };
        c.bench_function(
            &format!("tokenize_chatml_{n}_tokens_next_turn_answer_warmed_as_needed"),
            |b| {
                b.iter_batched(
                    || {
                        let (answer, last, held) = fresh_turn();
                        warm(&answer);
                        (answer, last, held)
                    },
                    |(answer, last, held)| {
                        let conversation: Vec<(&str, &str)> = vec![
                            messages[0],
                            messages[1],
                            ("assistant", &answer),
                            ("user", &last),
                        ];
                        let input = Input::Chat(std::hint::black_box(conversation));
                        chatml_cached
                            .ids_as_needed("m", &input, &mut held_upto(held), 0, usize::MAX, &mut 0)
                            .is_ok()
                    },
                    criterion::BatchSize::SmallInput,
                )
            },
        );
        c.bench_function(&format!("warm_chatml_{n}_tokens_answer"), |b| {
            b.iter_batched(
                &mut fresh_turn,
                |(answer, _, _)| warm(std::hint::black_box(&answer)),
                criterion::BatchSize::SmallInput,
            )
        });
    }
}

criterion_group!(benches, batches, tokenize);
criterion_main!(benches);

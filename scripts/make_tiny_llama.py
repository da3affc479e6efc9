#!/usr/bin/env python3
"""Write a tiny random-weight Llama model as GGUF, deterministically, for real-engine tests.

    .venv/bin/python scripts/make_tiny_llama.py OUT.gguf [--seed N]

Nothing is downloaded: the weights are random (numpy, fixed seed) and the tokenizer is built
here. Same arguments, same bytes. The model is what llama.cpp's `llama` architecture expects:

- 2 layers, hidden size 64, 4 heads (head size 16, rope over all of it), FFN 128, RMS norm,
  context length 4096, F32 tensors (about 0.4 MB).
- A SentencePiece-style (`tokenizer.ggml.model = llama`) vocabulary of 478 pieces:
  <unk> <s> </s>, the 256 byte-fallback pieces <0x00>..<0xFF>, `▁`, every printable ASCII
  character alone and with a leading `▁`, and a few common English words. Any text
  tokenizes (unknown characters fall back to bytes), most ASCII characters as one token.
- A chat template in `tokenizer.chat_template` (`<|role|>content` lines, then `<|assistant|>`).

The weights are random, so the text is gibberish, with one arrangement: hidden dimension 0
carries a constant that no layer writes to, and the output head reads it as a bias that
favours the printable pieces. So generation continues until `max_tokens` (end-of-sequence is
never picked in practice) and yields printable ASCII rather than lone bytes that would not
be valid UTF-8.
"""

import argparse
import string
import sys
from pathlib import Path

import numpy as np
import gguf

N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_HEAD_KV = 4
N_FF = 128
N_CTX = 4096
HEAD_DIM = N_EMBD // N_HEAD

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "of", "to", "in",
    "is", "it", "you", "that", "he", "was", "for", "on", "are", "with", "as", "hello", "world",
    "user", "system", "assistant", "please", "stream",
]


def vocabulary():
    """(pieces, scores, types): SPM pieces with byte fallback."""
    tt = gguf.TokenType
    pieces = ["<unk>", "<s>", "</s>"]
    types = [tt.UNKNOWN, tt.CONTROL, tt.CONTROL]
    for b in range(256):
        pieces.append(f"<0x{b:02X}>")
        types.append(tt.BYTE)
    printable = [c for c in string.printable if c.isprintable() and c != " "]
    normal = ["\u2581"] + printable + ["\u2581" + c for c in printable] + ["\u2581" + w for w in WORDS]
    for p in normal:
        pieces.append(p)
        types.append(tt.NORMAL)
    assert len(set(pieces)) == len(pieces)
    # SPM merges pick the highest-scoring pair: longer pieces score higher.
    scores = [0.0] * 3 + [-1000.0] * 256 + [float(len(p)) - 100.0 for p in normal]
    return pieces, scores, types


def weights(n_vocab, printable_mask, seed):
    rng = np.random.default_rng(seed)

    def mat(rows, cols, std):
        return rng.normal(0.0, std, size=(rows, cols)).astype(np.float32)

    t = {}
    embd = mat(n_vocab, N_EMBD, 0.5)
    embd[:, 0] = 8.0  # the constant "bias" dimension
    t["token_embd.weight"] = embd
    for i in range(N_LAYER):
        p = f"blk.{i}"
        t[f"{p}.attn_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        t[f"{p}.attn_q.weight"] = mat(N_EMBD, N_EMBD, 0.3)
        t[f"{p}.attn_k.weight"] = mat(N_HEAD_KV * HEAD_DIM, N_EMBD, 0.3)
        t[f"{p}.attn_v.weight"] = mat(N_HEAD_KV * HEAD_DIM, N_EMBD, 0.3)
        out = mat(N_EMBD, N_EMBD, 0.1)
        out[0, :] = 0.0  # nothing writes to dimension 0
        t[f"{p}.attn_output.weight"] = out
        t[f"{p}.ffn_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        t[f"{p}.ffn_gate.weight"] = mat(N_FF, N_EMBD, 0.3)
        t[f"{p}.ffn_up.weight"] = mat(N_FF, N_EMBD, 0.3)
        down = mat(N_EMBD, N_FF, 0.1)
        down[0, :] = 0.0
        t[f"{p}.ffn_down.weight"] = down
    t["output_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
    head = mat(n_vocab, N_EMBD, 1.0)
    head[:, 0] = np.where(printable_mask, 1.0, -3.0).astype(np.float32)
    t["output.weight"] = head
    return t


def write(path: Path, seed: int) -> None:
    pieces, scores, types = vocabulary()
    printable_mask = np.array([ty == gguf.TokenType.NORMAL for ty in types])
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("switchyard-tiny-llama")
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(pieces))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, data in weights(len(pieces), printable_mask, seed).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the .gguf file to write")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    write(tmp, args.seed)
    tmp.replace(args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

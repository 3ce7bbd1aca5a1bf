// Reference tokenizer server for data/tokenizer's tests.
//
// Reads one JSON request per line on stdin and answers one JSON line on
// stdout, in order:
//   {"impl": "hf" | "tjs", "tokenizer": "/path/tokenizer.json",
//    "config": "/path/tokenizer_config.json" (tjs only),
//    "text": "...", "special": false}
//   -> {"ids": [...], "offsets": [[start, end], ...], "decoded": "..."}
//      or {"error": "..."}
// With "op": "pretok" (hf only) the answer is the pre-tokenizer's split of
// the text alone: {"offsets": [[start, end], ...]}.
// "hf" is HF tokenizers itself (the Rust library behind transformers' fast
// tokenizers, npm package "tokenizers"); its offsets, counted in code points,
// are converted to UTF-8 byte offsets. "tjs" is transformers.js
// (@lenml/tokenizers), which has no offsets. "special": true asks for the
// model's special tokens (BOS) to be added, as add_special_tokens=True does.
//
// Run from the repository root after scripts/setup-test.sh:
//   node data/tokenizer/testdata/reference.js < requests.jsonl
"use strict";
const path = require("path");
const fs = require("fs");
const readline = require("readline");

const npm = path.resolve(__dirname, "../../../testdata-fetched/npm/node_modules");
const hf = require(path.join(npm, "tokenizers"));
const tjs = require(path.join(npm, "@lenml/tokenizers"));

const loaded = new Map();
function get(impl, file, config) {
  const key = impl + "\0" + file;
  let t = loaded.get(key);
  if (!t) {
    if (impl === "hf") {
      t = hf.Tokenizer.fromFile(file);
    } else {
      t = tjs.TokenizerLoader.fromPreTrained({
        tokenizerJSON: JSON.parse(fs.readFileSync(file, "utf8")),
        tokenizerConfig: JSON.parse(fs.readFileSync(config, "utf8")),
      });
    }
    loaded.set(key, t);
  }
  return t;
}

// byteOffsets[i] is the UTF-8 byte offset of code point i of s.
function byteOffsets(s) {
  const out = [0];
  let b = 0;
  for (const ch of s) {
    const c = ch.codePointAt(0);
    b += c < 0x80 ? 1 : c < 0x800 ? 2 : c < 0x10000 ? 3 : 4;
    out.push(b);
  }
  return out;
}

async function handle(req) {
  const t = get(req.impl, req.tokenizer, req.config);
  if (req.impl === "hf" && req.op === "pretok") {
    const bo = byteOffsets(req.text);
    const pieces = t.getPreTokenizer().preTokenizeString(req.text);
    return { offsets: pieces.map(([, [a, b]]) => [bo[a], bo[b]]) };
  }
  if (req.impl === "hf") {
    const enc = await t.encode(req.text, null, { addSpecialTokens: !!req.special });
    const ids = Array.from(enc.getIds());
    const bo = byteOffsets(req.text);
    const offsets = enc.getOffsets().map(([a, b]) => [bo[a], bo[b]]);
    const decoded = await t.decode(ids, false);
    return { ids, offsets, decoded };
  }
  const ids = t.encode(req.text, { add_special_tokens: !!req.special });
  return { ids, decoded: t.decode(ids) };
}

async function main() {
  const rl = readline.createInterface({ input: process.stdin, crlfDelay: Infinity });
  for await (const line of rl) {
    if (!line) continue;
    let res;
    try {
      res = await handle(JSON.parse(line));
    } catch (e) {
      res = { error: String((e && e.stack) || e) };
    }
    process.stdout.write(JSON.stringify(res) + "\n");
  }
}
main();

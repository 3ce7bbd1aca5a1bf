// Encode throughput of a reference tokenizer on one corpus file, for
// BenchmarkEncode's comparison. Usage:
//   node bench.js tjs|hf <model dir> <corpus file> <seconds>
// Prints {"mbps": MB/s (1e6 bytes), "tokens": tokens per pass}. The corpus is
// encoded whole, repeatedly, after one warm-up pass (caches warm, as in the
// Go benchmark). "hf" goes through napi and a worker thread per call.
"use strict";
const path = require("path");
const fs = require("fs");
const npm = path.resolve(__dirname, "../../../testdata-fetched/npm/node_modules");
const [impl, dir, file, secs] = process.argv.slice(2);
const text = fs.readFileSync(file, "utf8");
const bytes = Buffer.byteLength(text, "utf8");

async function main() {
  let enc;
  if (impl === "hf") {
    const t = require(path.join(npm, "tokenizers")).Tokenizer.fromFile(path.join(dir, "tokenizer.json"));
    enc = async () => (await t.encode(text, null, { addSpecialTokens: false })).getIds().length;
  } else {
    const t = require(path.join(npm, "@lenml/tokenizers")).TokenizerLoader.fromPreTrained({
      tokenizerJSON: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8")),
      tokenizerConfig: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"), "utf8")),
    });
    enc = async () => t.encode(text, { add_special_tokens: false }).length;
  }
  const tokens = await enc();
  let n = 0;
  const t0 = process.hrtime.bigint();
  let el = 0;
  do {
    await enc();
    n++;
    el = Number(process.hrtime.bigint() - t0) / 1e9;
  } while (el < Number(secs));
  console.log(JSON.stringify({ mbps: (bytes * n) / el / 1e6, tokens }));
}
main();

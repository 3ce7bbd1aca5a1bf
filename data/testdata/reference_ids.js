// Writes data/testdata/reference_ids.json, the independent reference for
// data's real-tokenizer tests: the token ids transformers.js
// (@lenml/tokenizers) gives for each text of reference_texts.json, without
// special tokens added (as apply_chat_template tokenizes a rendering).
//
// The texts are chat renderings written out by hand from the Qwen3 and
// Llama 3 templates, plus plain texts. Regenerate after scripts/setup-test.sh:
//   node data/testdata/reference_ids.js
"use strict";
const path = require("path");
const fs = require("fs");

const npm = path.resolve(__dirname, "../../testdata-fetched/npm/node_modules");
const tjs = require(path.join(npm, "@lenml/tokenizers"));

const cases = JSON.parse(fs.readFileSync(path.join(__dirname, "reference_texts.json"), "utf8"));
const out = [];
for (const c of cases) {
  const dir = path.join(npm, "@lenml/tokenizer-" + c.model, "models");
  const t = tjs.TokenizerLoader.fromPreTrained({
    tokenizerJSON: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8")),
    tokenizerConfig: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"), "utf8")),
  });
  out.push({ name: c.name, model: c.model, text: c.text, ids: t.encode(c.text, { add_special_tokens: false }) });
}
fs.writeFileSync(path.join(__dirname, "reference_ids.json"), JSON.stringify(out, null, 1) + "\n");

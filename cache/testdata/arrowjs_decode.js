// Reads a cache chunk file with Apache Arrow's JavaScript implementation
// (an Arrow reader independent of the Go one that wrote it) and decodes it
// with the formulas of the cache package doc, printing one JSON line per
// sample: {"index", "input_ids", "loss_mask", "topk_ids", "lp_bits"} where
// lp_bits are the float32 bit patterns of the decoded log-probs, and for
// the sampled kinds (format version 2) "draw_n", "draw_ids", "draw_counts"
// and "tail_bits" (head+sampled). The first line is the schema metadata. Usage: node arrowjs_decode.js NODE_MODULES CHUNK
'use strict';
const path = require('path');
const fs = require('fs');
const mods = process.argv[2];
const arrow = require(path.join(mods, 'apache-arrow'));
const fzstd = require(path.join(mods, 'fzstd'));
arrow.compressionRegistry.set(1 /* CompressionType.ZSTD */, { decode: (b) => fzstd.decompress(b) });

const table = arrow.tableFromIPC(fs.readFileSync(process.argv[3]));
const md = Object.fromEntries(table.schema.metadata);
console.log(JSON.stringify(md));
const K = Number(md['distill.k']);
const enc = md['distill.encoding'];
const col = (name) => table.getChild(name);
const list = (name, row) => col(name).get(row).toArray();
const dict = list('id_dict', 0);
const f32 = new Float32Array(1), u32 = new Uint32Array(f32.buffer);
const bits = (x) => { f32[0] = x; return u32[0]; };
for (let row = 0; row < table.numRows; row++) {
  const ids = Array.from(list('input_ids', row));
  const T = ids.length;
  const topk = [];
  const lp = [];
  if (K > 0) {
    const c0 = list('id_code0', row), c1 = list('id_code1', row), c2 = list('id_code2', row);
    for (let e = 0; e < T * K; e++) topk.push(dict[c0[e] + 256 * c1[e] + 65536 * c2[e]]);
  }
  if (K === 0) {
  } else if (enc === 'compact') {
    const top = list('lp_top', row), d0 = list('lp_delta0', row), d1 = list('lp_delta1', row);
    for (let t = 0; t < T; t++) {
      let acc = top[t];
      lp.push(bits(-acc / 4096));
      for (let j = 1; j < K; j++) {
        const e = t * (K - 1) + j - 1;
        acc += 64 * (d0[e] + 256 * d1[e]);
        lp.push(bits(-acc / 4096));
      }
    }
  } else {
    const b = [0, 1, 2, 3].map((i) => list('lp_bits' + i, row));
    for (let e = 0; e < T * K; e++) lp.push((b[0][e] | (b[1][e] << 8) | (b[2][e] << 16) | (b[3][e] << 24)) >>> 0);
  }
  const out = {
    index: Number(col('index').get(row)), input_ids: ids,
    loss_mask: Array.from(list('loss_mask', row)), topk_ids: topk, lp_bits: lp,
  };
  if (md['distill.targets'] !== undefined) {
    // draw_n[t] distinct ids at position t; their codes and counts follow
    // one another in position order.
    out.draw_n = Array.from(list('draw_n', row));
    const d0 = list('draw_code0', row), d1 = list('draw_code1', row), d2 = list('draw_code2', row);
    const n0 = list('draw_count0', row), n1 = list('draw_count1', row);
    out.draw_ids = [];
    out.draw_counts = [];
    for (let e = 0; e < d0.length; e++) {
      out.draw_ids.push(dict[d0[e] + 256 * d1[e] + 65536 * d2[e]]);
      out.draw_counts.push(n0[e] + 256 * n1[e]);
    }
    if (md['distill.targets'] === 'head+sampled') {
      const b = [0, 1, 2, 3].map((i) => list('tail_bits' + i, row));
      out.tail_bits = [];
      for (let t = 0; t < T; t++) out.tail_bits.push((b[0][t] | (b[1][t] << 8) | (b[2][t] << 16) | (b[3][t] << 24)) >>> 0);
    }
  }
  console.log(JSON.stringify(out));
}

package trainer

import (
	"context"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"distill/cache"
	"distill/data"
	"distill/data/tokenizer"
)

// benchWords are the vocabulary of the benchmark's generated chats.
var benchWords = strings.Fields(`the model reads a packed row of tokens and predicts each next one from the
ones before it while attention stays inside every sample so that no compute is spent on padding
gradient accumulation sums the rows of a step and divides by the count of loss positions, which makes
the update that of the mean over the global batch whatever the packing; checkpoints hold the weights,
the optimizer moments and the data position, and a resumed run reproduces the uninterrupted one`)

// benchChats are n chat records with answers of 40 to 400 words.
func benchChats(n int) []map[string]any {
	r := rand.New(rand.NewPCG(1, 2))
	words := func(k int) string {
		w := make([]string, k)
		for i := range w {
			w[i] = benchWords[r.IntN(len(benchWords))]
		}
		return strings.Join(w, " ")
	}
	out := make([]map[string]any, n)
	for i := range out {
		out[i] = map[string]any{"messages": []map[string]string{
			{"role": "user", "content": "Explain: " + words(10+r.IntN(30)) + "?"},
			{"role": "assistant", "content": words(40+r.IntN(360)) + "."}}}
	}
	return out
}

// BenchmarkSFTDatasetVsCache trains the same student on the same tokens
// in one run, from a chat dataset (real Qwen3 tokenizer and template,
// tokenized ahead of the step) and from a cache holding that dataset's
// tokens (k = 64 compact top-k, kd_weight 0, so the loss is the same CE),
// two runs each in the order dataset, cache, cache, dataset: training
// tokens/s of each side (mean of its runs, steps after the first), the
// share of step time spent getting the data (data_s), and the data path
// alone (tokens pulled from each stream with no training). Under -short
// (the examples' check that the README's command runs) it runs one run a
// side of two steps, a quarter of the time.
//
//	go test ./train/trainer -run '^$' -bench SFTDatasetVsCache -benchtime 1x
func BenchmarkSFTDatasetVsCache(b *testing.B) {
	needQwen3(b)
	dir := b.TempDir()
	file := filepath.Join(dir, "chat.jsonl")
	writeJSONL(b, file, benchChats(600))
	tok, err := tokenizer.Load(qwen3Dir)
	if err != nil {
		b.Fatal(err)
	}
	const seqLen, batch, K = 1024, 4096, 64
	// ABBA: a load that drifts during the run weighs on both sides.
	steps, order := 6, []bool{true, false, false, true}
	if testing.Short() {
		steps, order = 2, []bool{true, false}
	}
	share := 2 / float64(len(order)) // a run's weight in its side's mean
	dc := &DatasetConfig{Files: []string{file}}
	opts, err := dc.options(seqLen)
	if err != nil {
		b.Fatal(err)
	}
	ds, err := data.Open(dc.sources(), tok, opts)
	if err != nil {
		b.Fatal(err)
	}
	defer ds.Close()
	all, err := ds.Range(context.Background(), 0, ds.Len())
	if err != nil {
		b.Fatal(err)
	}
	// The cache of the same tokens: a synthetic teacher top-k (distinct
	// ids, geometric probabilities), which SFT reads and decodes but does
	// not use.
	cacheDir := filepath.Join(dir, "cache")
	c, err := cache.Create(cacheDir, cache.Manifest{TeacherFingerprint: "bench", TokenizerFingerprint: tok.Fingerprint(), DatasetFingerprint: ds.Fingerprint(),
		VocabSize: 151936, K: K, Temperature: 1, Samples: ds.Len(), Encoding: cache.EncodingCompact}, nil)
	if err != nil {
		b.Fatal(err)
	}
	for a := int64(0); a < ds.Len(); a += 64 {
		e := min(a+64, ds.Len())
		w, err := c.BeginChunk(a, e)
		if err != nil {
			b.Fatal(err)
		}
		for _, s := range all[a:e] {
			T := len(s.IDs)
			ids, lps := make([]int32, T*K), make([]float32, T*K)
			for t := 0; t < T; t++ {
				for j := 0; j < K; j++ {
					ids[t*K+j] = int32((int(s.IDs[t]) + 1 + j*7919) % 151936)
					lps[t*K+j] = float32(float64(j+1) * math.Log(0.5))
				}
			}
			if err := w.Add(cache.Sample{Index: s.Index, Tokens: s.IDs, Mask: s.Mask, TopKIDs: ids, TopKLogProbs: lps}); err != nil {
				b.Fatal(err)
			}
		}
		if err := w.Commit(); err != nil {
			b.Fatal(err)
		}
	}
	c.Close()

	conf := func(runDir, source string) *Config {
		y := fmt.Sprintf(`run_dir: %s
model:
  random: {arch: qwen3, vocab_size: 151936, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
           num_key_value_heads: 2, head_dim: 16, intermediate_size: 192, max_position_embeddings: 2048,
           tie_word_embeddings: true, init_seed: 1}
  tokenizer: %s
data:
%s
  seq_len: %d
  global_batch_tokens: %d
  eval_range: [0, 8]
distill: {kd_weight: 0, sft_weight: 1}
optim: {lr: 1e-3, min_lr: 1e-4, warmup_steps: 1}
train: {max_steps: %d}
eval: {every: 0, max_samples: 1}
checkpoint: {every: 0, keep: 1}
log: {every: 100, progress: "off", tensorboard: false}
`, runDir, qwen3Dir, source, seqLen, batch, steps)
		p := filepath.Join(b.TempDir(), "c.yaml")
		os.WriteFile(p, []byte(y), 0o644)
		cfg, err := LoadConfig(p, nil)
		if err != nil {
			b.Fatal(err)
		}
		return cfg
	}
	type side struct {
		tps, dataShare, pullTPS float64
	}
	measure := func(cfg *Config, open func() (sampleStream, error)) side {
		res, err := Run(cfg, Options{Log: io.Discard})
		if err != nil {
			b.Fatal(err)
		}
		var tok, sec, dsec float64
		for _, s := range res.Steps[1:] {
			tok += float64(s.Tokens)
			sec += float64(s.Tokens) / s.TokensPerSec
			dsec += s.DataSeconds
		}
		// The data path alone: the same number of tokens pulled.
		st, err := open()
		if err != nil {
			b.Fatal(err)
		}
		defer st.close()
		t0, n := time.Now(), 0
		for n < steps*batch {
			s, err := st.next()
			if err != nil {
				b.Fatal(err)
			}
			n += len(s.Tokens)
		}
		return side{tps: tok / sec, dataShare: dsec / sec, pullTPS: float64(n) / time.Since(t0).Seconds()}
	}
	held := cache.Range{Start: 0, End: 8}
	rd, err := cache.OpenReader(cacheDir)
	if err != nil {
		b.Fatal(err)
	}
	runDS := func(name string) side {
		return measure(conf(filepath.Join(dir, name), "  dataset:\n    files: ["+file+"]"), func() (sampleStream, error) {
			return newDSStream(ds, 1, held, opts.Workers, 2*batch, 0, 0)
		})
	}
	runCache := func(name string) side {
		return measure(conf(filepath.Join(dir, name), "  cache: ["+cacheDir+"]"), func() (sampleStream, error) {
			return newStream(rd, 1, 4, held, 0, 0)
		})
	}
	for i := 0; i < b.N; i++ {
		var d, c side
		for k, dataset := range order {
			name := fmt.Sprint("run", i, "-", k)
			var x side
			if dataset {
				x = runDS(name)
				d.tps, d.dataShare, d.pullTPS = d.tps+x.tps*share, d.dataShare+x.dataShare*share, d.pullTPS+x.pullTPS*share
			} else {
				x = runCache(name)
				c.tps, c.dataShare, c.pullTPS = c.tps+x.tps*share, c.dataShare+x.dataShare*share, c.pullTPS+x.pullTPS*share
			}
		}
		b.ReportMetric(d.tps, "dataset-tokens/s")
		b.ReportMetric(c.tps, "cache-tokens/s")
		b.ReportMetric(d.tps/c.tps, "dataset/cache")
		b.ReportMetric(100*d.dataShare, "dataset-data-%")
		b.ReportMetric(100*c.dataShare, "cache-data-%")
		b.ReportMetric(d.pullTPS, "dataset-pull-tokens/s")
		b.ReportMetric(c.pullTPS, "cache-pull-tokens/s")
	}
}

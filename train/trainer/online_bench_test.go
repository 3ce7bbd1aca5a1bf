package trainer

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"distill/model"
)

// BenchmarkOnlineVsOffline measures online KD on loopback: a teacherd
// whose model has ~4x the student's parameters, one student; the
// student's tokens/s online against offline from a cache that teacher
// filled (same data, same steps), and the fraction of the online run's
// time it waited for the teacher. Teacher and student share this
// machine's cores. Run it once:
//
//	go test ./train/trainer -run '^$' -bench OnlineVsOffline -benchtime 1x
func BenchmarkOnlineVsOffline(b *testing.B) { benchOnlineVsOffline(b, 1) }

// BenchmarkOnlineMultiVsOffline is BenchmarkOnlineVsOffline with two
// teachers (two daemons, two models of the same size, weights 0.5/0.5):
// online multi-teacher KD against data.caches over caches they filled.
//
//	go test ./train/trainer -run '^$' -bench OnlineMultiVsOffline -benchtime 1x
func BenchmarkOnlineMultiVsOffline(b *testing.B) { benchOnlineVsOffline(b, 2) }

// benchOnlineVsOffline measures online KD with n teachers (1 or 2).
func benchOnlineVsOffline(b *testing.B, n int) {
	dir := b.TempDir()
	tokDir := filepath.Join(dir, "tok")
	os.MkdirAll(tokDir, 0o755)
	writeByteTokenizer(b, tokDir)
	recs := arithRecords(256, 1)
	for i, r := range recs {
		r["prompt"] = strings.Repeat(r["prompt"].(string)+" ", 8+i%4)
	}
	file := filepath.Join(dir, "long.jsonl")
	writeJSONL(b, file, recs)
	// Teacher: hidden 128, 2 layers, intermediate 384 (about 4x the
	// student's hidden 64, 2 layers, intermediate 128).
	tc, _ := model.Preset(model.ArchQwen3)
	tc.VocabSize, tc.Hidden, tc.Layers, tc.Intermediate, tc.MaxPositions, tc.Heads, tc.KVHeads, tc.HeadDim = 260, 128, 2, 384, 256, 4, 2, 32
	var (
		tds            []*teacherd
		tdir           string
		online, caches []string
	)
	for i := 0; i < n; i++ {
		tdir = b.TempDir()
		if err := model.WriteCheckpoint(tdir, tc, model.Init(tc, model.InitOptions{Seed: 5 + uint64(i), Std: 0.5, Perturb: true}), "BF16"); err != nil {
			b.Fatal(err)
		}
		td := startTeacherdBudget(b, tdir, tokDir, filepath.Join(dir, fmt.Sprintf("cache%d", i)), dir, 4096)
		tds = append(tds, td)
		online = append(online, fmt.Sprintf("{addrs: [%s], weight: 0.5}", td.addr()))
		caches = append(caches, fmt.Sprintf("{dir: %s, weight: 0.5}", td.cfg.Cache))
	}
	mk := func(name string, on bool, over ...string) *Config {
		src := fmt.Sprintf("  dataset:\n    files: [%s]\n", file)
		dist := fmt.Sprintf("  teachers: [%s]\n  k: 8\n  chunk_samples: 32\n  prefetch: 64\n", tds[0].addr())
		if n > 1 {
			dist = fmt.Sprintf("  teachers: [%s]\n  k: 8\n  chunk_samples: 32\n  prefetch: 64\n", strings.Join(online, ", "))
		}
		if !on {
			src, dist = fmt.Sprintf("  cache: [%s]\n", tds[0].cfg.Cache), ""
			if n > 1 {
				src = fmt.Sprintf("  caches: [%s]\n", strings.Join(caches, ", "))
			}
		}
		y := fmt.Sprintf(`run_dir: %s
seed: 3
model:
  random: {arch: qwen3, vocab_size: 260, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
           num_key_value_heads: 2, head_dim: 16, intermediate_size: 128, max_position_embeddings: 256, init_seed: 1}
  tokenizer: %s
data:
%s  seq_len: 256
  global_batch_tokens: 1024
distill:
  kd_weight: 1
  sft_weight: 0.1
%soptim: {lr: 1e-3}
train: {max_steps: 30, threads: 1}
eval: {every: 0}
checkpoint: {every: 1000, keep: 1}
log: {every: 1000, progress: "off", tensorboard: false}
`, filepath.Join(dir, name), tokDir, src, dist)
		p := filepath.Join(dir, name+".yaml")
		os.WriteFile(p, []byte(y), 0o644)
		cfg, err := LoadConfig(p, over)
		if err != nil {
			b.Fatal(err)
		}
		return cfg
	}
	on := mk("online", true)
	for _, td := range tds {
		fillCache(b, td, on)
	}
	sc, _ := on.Model.Random.ModelConfig()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		off := mk(fmt.Sprintf("offline%d", i), false)
		onc := mk(fmt.Sprintf("online%d", i), true)
		ro, err := Run(off, Options{Log: ioDiscard{}})
		if err != nil {
			b.Fatal(err)
		}
		rn, err := Run(onc, Options{Log: ioDiscard{}})
		if err != nil {
			b.Fatal(err)
		}
		tps := func(r *Result) (float64, float64) {
			var tok, sec, wait float64
			for _, s := range r.Steps[1:] { // the first step warms up
				tok += float64(s.Tokens)
				sec += float64(s.Tokens) / s.TokensPerSec
				wait += s.TeacherWaitSeconds
			}
			return tok / sec, wait / sec
		}
		offTPS, _ := tps(ro)
		onTPS, waitFrac := tps(rn)
		b.ReportMetric(offTPS, "offline_tok/s")
		b.ReportMetric(onTPS, "online_tok/s")
		b.ReportMetric(waitFrac, "online_wait_frac")
		b.Logf("%d teacher(s) of %d params, student %d params (%.1fx); student tokens/s: offline %.0f, online %.0f (%.2f of offline); online waited %.1f%% of its step time",
			n, tc.Params(), sc.Params(), float64(tc.Params())/float64(sc.Params()), offTPS, onTPS, onTPS/offTPS, 100*waitFrac)
	}
}

type ioDiscard struct{}

func (ioDiscard) Write(p []byte) (int, error) { return len(p), nil }

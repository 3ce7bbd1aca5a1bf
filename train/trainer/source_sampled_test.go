package trainer

import (
	"errors"
	"io"
	"math"
	"path/filepath"
	"strings"
	"testing"

	"distill/cache"
	"distill/cache/cachetest"
	"distill/train/testcache"
)

// sampledCache writes a cache of a sampled kind over made-up samples
// (V = 97, 48 samples of 8..30 tokens, N = 16 draws from cachetest's
// distributions), with testCache's tokenizer fingerprint.
func sampledCache(t *testing.T, kind cache.Targets) *testcache.Built {
	dir := filepath.Join(t.TempDir(), "cache")
	m := cache.Manifest{TeacherFingerprint: "t", TokenizerFingerprint: "testcache-tokenizer", DatasetFingerprint: "d",
		VocabSize: 97, Temperature: 1, Samples: 48, Encoding: cache.EncodingCompact, Targets: kind, Draws: 16}
	if kind == cache.TargetsHeadSampled {
		m.K = 4
	}
	c, err := cache.Create(dir, m, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	key := cache.DrawKey(m.DatasetFingerprint)
	for a := int64(0); a < 48; a += 16 {
		w, err := c.BeginChunk(a, a+16)
		if err != nil {
			t.Fatal(err)
		}
		for i := a; i < a+16; i++ {
			T := 8 + int(i%23)
			s := cache.Sample{Index: i, DrawN: make([]int32, T)}
			for tt := 0; tt < T; tt++ {
				p := cachetest.Dist(97, uint64(i*100)+uint64(tt))
				s.Tokens, s.Mask = append(s.Tokens, int32((i*13+int64(tt)*7)%97)), append(s.Mask, 1)
				var head []int32
				if m.K > 0 {
					ids, lps := cachetest.Head(p, m.K)
					head = ids
					s.TopKIDs, s.TopKLogProbs = append(s.TopKIDs, ids...), append(s.TopKLogProbs, lps...)
				}
				drawn, tail := cachetest.Draws(p, head, 16, func(d int) float64 { return cache.DrawUniform(key, i, tt, d) })
				n0 := len(s.DrawIDs)
				s.DrawIDs, s.DrawCounts = cache.Tally(drawn, s.DrawIDs, s.DrawCounts)
				s.DrawN[tt] = int32(len(s.DrawIDs) - n0)
				if m.K > 0 {
					s.TailMass = append(s.TailMass, float32(tail))
				}
			}
			if err := w.Add(s); err != nil {
				t.Fatal(err)
			}
		}
		if err := w.Commit(); err != nil {
			t.Fatal(err)
		}
	}
	return &testcache.Built{CacheDir: dir}
}

// TestSourceSampled trains a few steps on caches of both sampled kinds
// with distill.targets set to the kind (finite losses, an eval), and
// refuses a cache whose kind the run does not expect, and rev_kl on
// sampled targets, naming the keys.
func TestSourceSampled(t *testing.T) {
	for _, kind := range []cache.Targets{cache.TargetsSampled, cache.TargetsHeadSampled} {
		b := sampledCache(t, kind)
		cfg := tinyConfig(t, b, filepath.Join(t.TempDir(), "run"), "distill.targets="+string(kind), "train.max_steps=4", "eval.every=4")
		res, err := Run(cfg, Options{Log: io.Discard})
		if err != nil {
			t.Fatalf("%s: %v", kind, err)
		}
		if len(res.Steps) != 4 || len(res.Evals) != 1 {
			t.Fatalf("%s: %d steps, %d evals", kind, len(res.Steps), len(res.Evals))
		}
		for _, s := range res.Steps {
			if math.IsNaN(s.Loss) || math.IsInf(s.Loss, 0) || s.Loss <= 0 {
				t.Fatalf("%s: step loss %v", kind, s.Loss)
			}
		}
		// The run expects topk (the default): refused, naming both.
		_, err = Run(tinyConfig(t, b, filepath.Join(t.TempDir(), "run2")), Options{Log: io.Discard})
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "holds targets "+string(kind)) || !strings.Contains(err.Error(), "distill.targets is topk") {
			t.Fatalf("%s cache in a topk run: %v", kind, err)
		}
	}
	_, err := LoadConfigCheck(t, "distill.targets=sampled", "distill.kd_loss=rev_kl")
	if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "kd_loss rev_kl with targets sampled") {
		t.Fatalf("rev_kl on sampled targets: %v", err)
	}
}

// LoadConfigCheck loads tinyConfig's YAML with overrides and validates it.
func LoadConfigCheck(t *testing.T, over ...string) (*Config, error) {
	b := testCache(t)
	cfg := tinyConfig(t, b, t.TempDir())
	for _, o := range over {
		kv := strings.SplitN(o, "=", 2)
		switch kv[0] {
		case "distill.targets":
			cfg.Distill.Targets = kv[1]
		case "distill.kd_loss":
			cfg.Distill.KDLoss = kv[1]
		}
	}
	return cfg, cfg.Validate()
}

// Package testcache builds real caches for the trainer's tests: a tiny
// random teacher checkpoint (model.Init), its forward through the teacher
// code (infer.Load + TopK on the CPU backend), and the cache writer API.
// Nothing here is synthetic beyond the random weights and token ids: the
// top-k log-probs are the teacher's, normalized over the full vocabulary.
package testcache

import (
	"fmt"
	"math/rand/v2"
	"path/filepath"

	"distill/cache"
	"distill/compute/device"
	"distill/infer"
	"distill/model"
)

// Options describe the cache to build.
type Options struct {
	Dir            string // the cache goes to Dir/cache, the teacher to Dir/teacher
	Vocab, K       int
	Samples, Chunk int // sample count and samples per chunk
	MinLen, MaxLen int // sample lengths, uniform in [MinLen, MaxLen]
	Seed           uint64
	// TeacherSeed seeds the teacher's weights (0: Seed). The tokens,
	// masks and dataset fingerprint do not depend on it, so caches built
	// with the same options but TeacherSeed (and K) cover the same
	// samples: several teachers, for multi-teacher KD.
	TeacherSeed          uint64
	TokenizerFingerprint string  // default "testcache-tokenizer"
	Temperature          float32 // capture temperature, default 1
	Lossless             bool
}

// Built is what Build made.
type Built struct {
	CacheDir, TeacherDir string
	Manifest             cache.Manifest
	Samples              []cache.Sample // as written (the teacher's exact float32 log-probs)
}

// Build writes the teacher checkpoint and fills the whole cache.
func Build(o Options) (*Built, error) {
	if o.TokenizerFingerprint == "" {
		o.TokenizerFingerprint = "testcache-tokenizer"
	}
	if o.Temperature == 0 {
		o.Temperature = 1
	}
	teacherSeed := o.TeacherSeed
	if teacherSeed == 0 {
		teacherSeed = o.Seed
	}
	b := &Built{CacheDir: filepath.Join(o.Dir, "cache"), TeacherDir: filepath.Join(o.Dir, "teacher")}
	cfg, err := model.Preset(model.ArchQwen3)
	if err != nil {
		return nil, err
	}
	cfg.VocabSize, cfg.Hidden, cfg.Heads, cfg.KVHeads, cfg.HeadDim, cfg.Intermediate = o.Vocab, 32, 4, 2, 8, 64
	// A larger init std than HF's 0.02 gives the teacher peaked, varied
	// distributions, so a student has something to learn.
	if err := model.WriteCheckpoint(b.TeacherDir, cfg, model.Init(cfg, model.InitOptions{Seed: teacherSeed, Std: 0.3}), "BF16"); err != nil {
		return nil, err
	}
	tm, err := infer.Load(b.TeacherDir, device.CPU(0))
	if err != nil {
		return nil, err
	}
	enc := cache.EncodingCompact
	if o.Lossless {
		enc = cache.EncodingLossless
	}
	b.Manifest = cache.Manifest{TeacherFingerprint: tm.Fingerprint(), TokenizerFingerprint: o.TokenizerFingerprint,
		DatasetFingerprint: fmt.Sprintf("testcache-%d", o.Seed), VocabSize: o.Vocab, K: o.K, Temperature: o.Temperature,
		Samples: int64(o.Samples), Encoding: enc}
	c, err := cache.Create(b.CacheDir, b.Manifest, nil)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	b.Manifest = c.Manifest()
	rng := rand.New(rand.NewPCG(o.Seed, 7))
	for a := 0; a < o.Samples; a += o.Chunk {
		e := min(a+o.Chunk, o.Samples)
		toks := make([][]int32, e-a)
		for i := range toks {
			n := o.MinLen + rng.IntN(o.MaxLen-o.MinLen+1)
			toks[i] = make([]int32, n)
			for j := range toks[i] {
				toks[i][j] = int32(rng.IntN(o.Vocab))
			}
		}
		res, err := tm.TopK(toks, infer.Options{K: o.K, Temperature: o.Temperature})
		if err != nil {
			return nil, err
		}
		w, err := c.BeginChunk(int64(a), int64(e))
		if err != nil {
			return nil, err
		}
		for i := range toks {
			// A prompt of 1..3 tokens is masked out, as chat SFT data is.
			mask := make([]uint8, len(toks[i]))
			for j := 1 + rng.IntN(3); j < len(mask); j++ {
				mask[j] = 1
			}
			s := cache.Sample{Index: int64(a + i), Tokens: toks[i], Mask: mask, TopKIDs: res[i].IDs, TopKLogProbs: res[i].LogProbs}
			if err := w.Add(s); err != nil {
				return nil, err
			}
			b.Samples = append(b.Samples, s)
		}
		if err := w.Commit(); err != nil {
			return nil, err
		}
	}
	return b, nil
}

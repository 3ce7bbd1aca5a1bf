package model

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"

	"distill/internal/atomicfile"
)

// InitOptions control random initialization.
type InitOptions struct {
	Seed uint64
	// Std of the normal init of matrices (HF initializer_range, 0.02).
	Std float64
	// Perturb draws norm weights as 1+N(0,0.1²) and biases as N(0,Std²)
	// instead of ones and zeros, so tests exercise every parameter.
	Perturb bool
	// DType of the written tensors: "BF16" (default) or "F32".
	DType string
}

// Init returns random tensors for a checkpoint of cfg, as float32 values in
// the order of cfg.Tensors(). Initialization is deterministic in Seed.
func Init(cfg *Config, opt InitOptions) map[string][]float32 {
	if opt.Std == 0 {
		opt.Std = 0.02
	}
	out := map[string][]float32{}
	for i, s := range cfg.Tensors() {
		// One stream per tensor, so adding a tensor does not shift others.
		r := rand.New(rand.NewPCG(opt.Seed, uint64(i)))
		n := 1
		for _, d := range s.Shape {
			n *= d
		}
		v := make([]float32, n)
		switch {
		case s.Norm && opt.Perturb:
			for j := range v {
				v[j] = float32(1 + 0.1*r.NormFloat64())
			}
		case s.Norm:
			for j := range v {
				v[j] = 1
			}
		case s.Bias && !opt.Perturb:
		default:
			for j := range v {
				v[j] = float32(opt.Std * r.NormFloat64())
			}
		}
		out[s.Name] = v
	}
	return out
}

// WriteCheckpoint writes an HF checkpoint directory: config.json and
// model.safetensors holding tensors (every tensor of cfg.Tensors(), as BF16
// or F32). It creates dir if needed.
func WriteCheckpoint(dir string, cfg *Config, tensors map[string][]float32, dtype string) error {
	if dtype == "" {
		dtype = "BF16"
	}
	if dtype != "BF16" && dtype != "F32" {
		return fmt.Errorf("model: checkpoint dtype %q: want BF16 or F32", dtype)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	var ts []Tensor
	for _, s := range cfg.Tensors() {
		v, ok := tensors[s.Name]
		if !ok {
			return fmt.Errorf("model: writing checkpoint: missing tensor %s", s.Name)
		}
		if dtype == "BF16" {
			ts = append(ts, BF16Tensor(s.Name, s.Shape, v))
		} else {
			ts = append(ts, F32Tensor(s.Name, s.Shape, v))
		}
	}
	if err := WriteSafetensors(filepath.Join(dir, "model.safetensors"), ts, map[string]string{"format": "pt"}); err != nil {
		return err
	}
	cj, err := cfg.JSON()
	if err != nil {
		return err
	}
	return atomicfile.WriteFile(filepath.Join(dir, "config.json"), append(cj, '\n'), 0o644)
}

// Preset returns a small config of an architecture for tests and demos;
// fields can be overridden afterwards.
func Preset(arch Arch) (*Config, error) {
	c := &Config{Arch: arch, VocabSize: 1000, Hidden: 64, Layers: 2, Heads: 4, KVHeads: 2, HeadDim: 16,
		Intermediate: 128, MaxPositions: 2048, RMSNormEps: 1e-6, RopeTheta: 10000, BOSTokenID: -1, EOSTokenID: -1}
	switch arch {
	case ArchLlama:
		c.RopeTheta = 500000
		c.RopeScaling = &RopeScaling{Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPos: 64}
	case ArchQwen2:
		c.AttentionBias = true
		c.TieEmbeddings = true
		c.RopeTheta = 1000000
	case ArchQwen3:
		c.QKNorm = true
		c.HeadDim = 32 // explicit head_dim != hidden/heads, as in Qwen3
		c.RopeTheta = 1000000
	case ArchQwen3MoE:
		c.QKNorm = true
		c.HeadDim = 32
		c.RopeTheta = 1000000
		c.Layers = 3
		c.NumExperts, c.ExpertsPerTok, c.MoEIntermediate, c.DecoderSparseStep = 8, 2, 32, 1
		c.NormTopKProb = true
		c.MLPOnlyLayers = []int{1}
	default:
		return nil, fmt.Errorf("%w: unknown architecture %q", ErrConfig, arch)
	}
	return c, nil
}

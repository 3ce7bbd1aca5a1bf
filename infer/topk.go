package infer

import (
	"fmt"

	"distill/internal/errkind"
)

// Options control TopK.
type Options struct {
	// K is the number of top tokens kept per position, 1..vocab.
	K int
	// TokenBudget caps the tokens of one forward pass (default 8192); it
	// bounds activation memory (package doc). A sample longer than the
	// budget is an error.
	TokenBudget int
	// Temperature divides the logits before the softmax (default 1).
	Temperature float32
}

// DefaultTokenBudget is the forward-pass size when Options.TokenBudget is 0.
const DefaultTokenBudget = 8192

// Result holds one sample's top-k: row t (k entries) is the distribution
// of the token after position t.
type Result struct {
	IDs      []int32   // (len(sample), K), descending probability
	LogProbs []float32 // (len(sample), K), normalized over the full vocabulary
}

func (o *Options) defaults() {
	if o.TokenBudget == 0 {
		o.TokenBudget = DefaultTokenBudget
	}
	if o.Temperature == 0 {
		o.Temperature = 1
	}
}

// Validate checks samples and options against the model: every error names
// the sample (and position) and the limit it breaks.
func (m *Model) Validate(samples [][]int32, opt Options) error {
	opt.defaults()
	V := m.Cfg.VocabSize
	if opt.K <= 0 || opt.K > V {
		return errkind.Errorf(ErrInput, "k=%d out of range: want 1..%d (the vocab size)", opt.K, V)
	}
	if opt.TokenBudget < 1 {
		return errkind.Errorf(ErrInput, "token budget %d must be positive", opt.TokenBudget)
	}
	if !(opt.Temperature > 0) {
		return errkind.Errorf(ErrInput, "temperature %v must be > 0", opt.Temperature)
	}
	if len(samples) == 0 {
		return fmt.Errorf("%w: no samples", ErrInput)
	}
	for i, s := range samples {
		switch {
		case len(s) == 0:
			return errkind.Errorf(ErrInput, "sample %d is empty", i)
		case len(s) > m.Cfg.MaxPositions:
			return errkind.Errorf(ErrInput, "sample %d has %d tokens, more than max_position_embeddings %d: truncate it", i, len(s), m.Cfg.MaxPositions)
		case len(s) > opt.TokenBudget:
			return errkind.Errorf(ErrInput, "sample %d has %d tokens, more than the token budget %d: raise the budget", i, len(s), opt.TokenBudget)
		}
		for p, id := range s {
			if id < 0 || int(id) >= V {
				return errkind.Errorf(ErrInput, "sample %d position %d: token id %d out of range [0,%d)", i, p, id, V)
			}
		}
	}
	return nil
}

// TopK validates samples, packs them in order into forward passes of at
// most opt.TokenBudget tokens, and returns each sample's top-k.
func (m *Model) TopK(samples [][]int32, opt Options) ([]Result, error) {
	if err := m.Validate(samples, opt); err != nil {
		return nil, err
	}
	opt.defaults()
	out := make([]Result, len(samples))
	// The forwards are started back to back, InFlight at once: a
	// pipelined teacher's stages then go from one to the next without
	// draining (one backend runs each as it is started).
	type started struct {
		a, b int
		wait func() ([]int32, []float32)
	}
	var inFlight []started
	finish := func(f started) {
		ids, lps := f.wait()
		off := 0
		for i := f.a; i < f.b; i++ {
			sz := len(samples[i]) * opt.K
			out[i] = Result{IDs: ids[off : off+sz : off+sz], LogProbs: lps[off : off+sz : off+sz]}
			off += sz
		}
	}
	for a := 0; a < len(samples); {
		b, n := a, 0
		for b < len(samples) && n+len(samples[b]) <= opt.TokenBudget {
			n += len(samples[b])
			b++
		}
		inFlight = append(inFlight, started{a, b, m.StartForward(samples[a:b], opt.K, opt.Temperature)})
		if len(inFlight) >= m.InFlight() {
			finish(inFlight[0])
			inFlight = inFlight[1:]
		}
		a = b
	}
	for _, f := range inFlight {
		finish(f)
	}
	return out, nil
}

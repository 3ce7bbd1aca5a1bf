// Package infer is the teacher: it loads an HF checkpoint onto a compute
// backend and runs the decoder (package model/decoder, the one the student
// trains) over packed batches of samples, returning each position's top-k
// next-token ids and log-probs normalized over the full vocabulary.
//
// # Packing
//
// Samples of different lengths are concatenated into one token stream; the
// attention of each token sees only earlier tokens of its own sample
// (block-diagonal causal), and positions restart at 0 for every sample, so a
// packed batch gives the outputs each sample would give alone.
//
// # Memory
//
// Beside the weights (fp32 on the CPU: 4 bytes a parameter), a forward over
// n tokens holds fp32 activations of about n·(3H + 2Hq + 2Hkv + 2I + 4k +
// head_dim) floats (H hidden, Hq = heads·head_dim, Hkv = kv_heads·head_dim,
// I intermediate, k the top-k) plus per-core scratch: attention scores for
// 128 queries x the longest sample, and one 256 x 2048 LM-head tile. The
// [tokens x vocab] logits are never held. ActivationBytes gives the exact
// bound (a test holds Forward to it); TopK cuts its input into forward
// passes of at most Options.TokenBudget tokens, which bounds n.
//
// # Several GPUs
//
// LoadStages splits the decoder's layers over several backends (GPUs), a
// pipeline stage each (decoder.Pipeline): SplitLayers balances them by
// bytes, Forward cuts each batch into micro-batches that flow through
// the stages, StartForward starts one so that a caller keeping InFlight
// of them started (serve's batcher) has the batches follow each other
// through the stages without the pipeline draining in between,
// CheckDeviceFit checks each GPU, and the plan on paper (PlanTeacher,
// plan.go) says before anything loads what each GPU will hold and the
// largest token budget.
package infer

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"distill/compute"
	"distill/internal/errkind"
	"distill/model"
	"distill/model/decoder"
)

// ErrInput marks a request the model cannot serve as given (bad ids, empty
// or over-long samples, k out of range); the message says which and why.
var ErrInput = errors.New("infer: invalid input")

// Model is a loaded teacher: the decoder, on one backend or split into
// pipeline stages over several (LoadStages), and the checkpoint's
// fingerprint.
type Model struct {
	Cfg *model.Config

	stages      []stage // one per backend, in layer order
	pipe        *decoder.Pipeline
	fingerprint string
	weights     WeightFormat // LoadOptions.Weights
	loaded      []loadedTensor
}

// Free releases the teacher's weights on its backends; the model must not
// be used after.
func (m *Model) Free() {
	for _, t := range m.loaded {
		t.be.Free(t.t)
	}
	m.loaded = nil
	for _, s := range m.stages {
		s.d.Free() // (the RoPE table each stage keeps on its backend)
	}
}

// stage is one backend's part of the teacher.
type stage struct {
	d    *decoder.Model
	be   compute.Backend
	plan StagePlan // its layers and weights' bytes (BF16, on paper)
}

// last is the stage with the LM head (the only one on one backend).
func (m *Model) last() *stage { return &m.stages[len(m.stages)-1] }

// Backend returns the backend the model runs on: in a pipeline, the last
// stage's (the LM head's).
func (m *Model) Backend() compute.Backend { return m.last().be }

// Backends returns the backends of the stages, in layer order.
func (m *Model) Backends() []compute.Backend {
	out := make([]compute.Backend, len(m.stages))
	for i, s := range m.stages {
		out[i] = s.be
	}
	return out
}

// Stages describes how the layers are split over the backends: one
// StagePlan per backend (Device: its index in Backends).
func (m *Model) Stages() []StagePlan {
	out := make([]StagePlan, len(m.stages))
	for i, s := range m.stages {
		out[i] = s.plan
		out[i].Device = i
	}
	return out
}

// Fingerprint identifies the teacher: sha256 over config.json and every
// safetensors file, hex. Two caches filled by teachers with different
// fingerprints must not be mixed.
func (m *Model) Fingerprint() string { return m.fingerprint }

// Load reads an HF checkpoint directory onto be, its weights as the
// checkpoint gives them (LoadWith's bf16).
func Load(dir string, be compute.Backend) (*Model, error) {
	return LoadWith(dir, be, LoadOptions{})
}

// LoadWith reads an HF checkpoint directory onto be as o says (FP8
// weights: LoadOptions.Weights).
func LoadWith(dir string, be compute.Backend, o LoadOptions) (*Model, error) {
	return LoadStages(dir, []compute.Backend{be}, o)
}

// LoadStages reads an HF checkpoint directory onto the backends bes, its
// decoder layers split over them as SplitLayers balances them (the
// embedding on the first, the final norm and LM head on the last), each
// stage's weights on its own backend: a pipelined teacher whose forwards
// flow through the stages in micro-batches (decoder.Pipeline;
// LoadOptions.MicroBatches). A GPU may serve more than one stage (open a
// backend per stage: a stream each). One backend is LoadWith. A device
// that runs out of memory while its stage loads is an error naming it,
// the stage and what it had free, and what is loaded so far is freed.
func LoadStages(dir string, bes []compute.Backend, o LoadOptions) (*Model, error) {
	for _, be := range bes {
		if err := o.check(be); err != nil {
			return nil, err
		}
	}
	cfg, err := model.LoadConfig(dir)
	if err != nil {
		return nil, err
	}
	if len(bes) == 0 || len(bes) > max(1, cfg.Layers) {
		return nil, errkind.Errorf(ErrInput, "%s: %d stages for %d layers: want 1 to %d", dir, len(bes), cfg.Layers, max(1, cfg.Layers))
	}
	w, err := model.OpenWeights(dir)
	if err != nil {
		return nil, err
	}
	defer w.Close()
	fp8, err := fp8Checkpoint(dir, w)
	if err != nil {
		return nil, err
	}
	if fp8.fp8 && o.Weights != WeightsFP8 {
		return nil, errkind.Errorf(ErrInput, "%s holds FP8 weights (F8_E4M3 with weight_scale: compressed-tensors or ModelOpt FP8, or weight_scale_inv: block-wise, Qwen's and DeepSeek's FP8 releases): load it with --weights fp8", dir)
	}
	o.fp8Block = fp8.block
	m, err := newStages(cfg, w, bes, o, fp8.fp8)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	m.weights = o.Weights
	m.fingerprint, err = fingerprint(dir, o.fingerprintSuffix())
	if err != nil {
		return nil, err
	}
	return m, nil
}

// fingerprint hashes config.json and the safetensors files of dir, and
// suffix (the load options that change the outputs; "" for none).
func fingerprint(dir, suffix string) (string, error) {
	h := sha256.New()
	files, _ := filepath.Glob(filepath.Join(dir, "*.safetensors"))
	sort.Strings(files)
	for _, p := range append([]string{filepath.Join(dir, "config.json")}, files...) {
		f, err := os.Open(p)
		if err != nil {
			return "", err
		}
		fmt.Fprintf(h, "%s\x00", filepath.Base(p))
		_, err = io.Copy(h, f)
		f.Close()
		if err != nil {
			return "", fmt.Errorf("infer: hashing %s: %w", p, err)
		}
	}
	if suffix != "" {
		fmt.Fprintf(h, "\x00%s", suffix)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// New binds the tensors of w to a model of cfg on be. Missing, extra and
// mis-shaped tensors are errors naming the tensor.
func New(cfg *model.Config, w *model.Weights, be compute.Backend) (*Model, error) {
	return newStages(cfg, w, []compute.Backend{be}, LoadOptions{}, false)
}

// newStages binds the tensors of w to the stages of a model of cfg over
// bes (LoadStages) with the load options o; fp8: w is an FP8 checkpoint
// (fp8Checkpoint), checked as one.
func newStages(cfg *model.Config, w *model.Weights, bes []compute.Backend, o LoadOptions, fp8 bool) (*Model, error) {
	check := w.Check
	if fp8 {
		check = func(cfg *model.Config) error { return checkFP8Checkpoint(cfg, w) }
	}
	if err := check(cfg); err != nil {
		return nil, err
	}
	f := o.Weights
	if f == "" {
		f = WeightsBF16
	}
	plans := []StagePlan{{Embed: true, Head: true, EndLayer: cfg.Layers}}
	if len(bes) > 1 {
		plans = SplitLayers(cfg, len(bes), f)
	} else if cfg.Layers > 0 {
		plans[0].WeightBytes = SplitLayers(cfg, 1, f)[0].WeightBytes // named if the load runs out of memory
	}
	m := &Model{Cfg: cfg}
	var loaded []loadedTensor
	for i, be := range bes {
		d, err := loadStage(cfg, w, be, o, plans[i], len(bes) > 1, &loaded)
		if err != nil {
			for _, t := range loaded {
				t.be.Free(t.t)
			}
			return nil, err
		}
		m.stages = append(m.stages, stage{d: d, be: be, plan: plans[i]})
	}
	ds := make([]*decoder.Model, len(m.stages))
	for i, s := range m.stages {
		ds[i] = s.d
	}
	pipe, err := decoder.NewPipeline(ds)
	if err != nil {
		return nil, err
	}
	pipe.MicroBatches, pipe.MinMicroTokens = o.MicroBatches, o.MinMicroTokens
	m.pipe, m.loaded = pipe, loaded
	return m, nil
}

// loadedTensor is a weight on its backend, freed if the load fails.
type loadedTensor struct {
	be compute.Backend
	t  compute.Tensor
}

// loadStage binds stage p's tensors of w on be as o says; an
// out-of-memory failure of the backend is a *FitError naming the tensor,
// the device and the stage (piped: the stage's layers too), and what the
// device had free, and no tensor is loaded after it (each would fail the
// same way, and the error would say so once for each).
func loadStage(cfg *model.Config, w *model.Weights, be compute.Backend, o LoadOptions, p StagePlan, piped bool, loaded *[]loadedTensor) (*decoder.Model, error) {
	free := int64(-1)
	if dm, ok := be.(compute.DeviceMemory); ok {
		free, _ = dm.MemInfo()
	}
	format := o.Weights
	if format == "" {
		format = WeightsBF16
	}
	failed := false
	return decoder.NewStage(cfg, be, func(name string) (t compute.Tensor, _ compute.Tensor, err error) {
		if failed {
			return nil, nil, nil // the stage fails with the first error
		}
		defer func() {
			if r := recover(); r != nil {
				t, err, failed = nil, loadFailure(be, name, p, piped, free, format, r), true
			}
		}()
		if t, err = bindWeight(be, w, name, o); err != nil {
			return nil, nil, err
		}
		*loaded = append(*loaded, loadedTensor{be, t})
		return t, nil, nil
	}, p.FirstLayer, p.EndLayer)
}

// loadFailure turns a backend's panic while loading tensor name into an
// error naming the device and the stage: a *FitError for an out-of-memory
// error (free: what the device had before the stage's weights, -1 if not
// known; format: the weights' format on the device).
func loadFailure(be compute.Backend, name string, p StagePlan, piped bool, free int64, format WeightFormat, r any) error {
	err, ok := r.(error)
	if !ok {
		err = fmt.Errorf("%v", r)
	}
	where := compute.DeviceName(be)
	if piped {
		where = fmt.Sprintf("%s (pipeline stage of %s)", where, p.What())
	}
	if !errors.Is(err, compute.ErrOutOfMemory) {
		return fmt.Errorf("loading %s onto %s: %w", name, where, err)
	}
	had := ""
	if free >= 0 {
		stage := "its weights"
		if piped {
			stage = "this stage's weights"
		}
		had = fmt.Sprintf("; it had %s free before %s, which take about %s in %s", humanBytes(free), stage, humanBytes(p.WeightBytes), format)
	}
	return &FitError{Device: where, Weights: true, Piped: piped, Err: err,
		What: fmt.Sprintf("loading %s ran out of memory (%s)%s", name, strings.TrimPrefix(err.Error(), "cuda: "), had)}
}

// Forward runs the decoder over one packed batch and returns each position's
// top-k: ids (n,k) and log-probs (n,k), n the total tokens. samples must be
// valid (see Validate); temperature scales the logits (1: none).
func (m *Model) Forward(samples [][]int32, k int, temperature float32) (ids []int32, logprobs []float32) {
	return m.pipe.TopK(samples, k, temperature)
}

// StartForward is Forward started: it returns at once, and wait returns
// the result. Forwards started are served in order, and on a pipelined
// teacher they overlap: the first stage takes the next forward while the
// later ones finish this one (decoder.Pipeline.Start). wait raises a
// stage's failure (a panic naming the stage and its GPU). On one backend
// the forward runs before StartForward returns.
func (m *Model) StartForward(samples [][]int32, k int, temperature float32) (wait func() (ids []int32, logprobs []float32)) {
	if len(m.stages) == 1 { // a panic raised where it happens
		ids, lps := m.Forward(samples, k, temperature)
		return func() ([]int32, []float32) { return ids, lps }
	}
	return m.pipe.StartTopK(samples, k, temperature)
}

// InFlight is how many forwards to keep started at once (StartForward)
// so that every stage has one to work on: one a stage.
func (m *Model) InFlight() int { return len(m.stages) }

// Cut is how a forward of samples is cut into micro-batches: runs [a, b)
// of the samples (one run on one backend, unless LoadOptions asks).
func (m *Model) Cut(samples [][]int32) [][2]int { return m.pipe.Cut(samples) }

// humanBytes writes b in GiB, MiB or KiB, whichever reads best.
func humanBytes(b int64) string {
	switch {
	case b >= 1<<30:
		return fmt.Sprintf("%.2f GiB", float64(b)/(1<<30))
	case b >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20))
	}
	return fmt.Sprintf("%.1f KiB", float64(b)/(1<<10))
}

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

	"distill/compute"
	"distill/model"
	"distill/model/decoder"
)

// ErrInput marks a request the model cannot serve as given (bad ids, empty
// or over-long samples, k out of range); the message says which and why.
var ErrInput = errors.New("infer: invalid input")

// Model is a loaded teacher: the decoder and the checkpoint's fingerprint.
type Model struct {
	Cfg *model.Config

	d           *decoder.Model
	be          compute.Backend
	fingerprint string
	weights     WeightFormat // LoadOptions.Weights
}

// Backend returns the backend the model runs on.
func (m *Model) Backend() compute.Backend { return m.be }

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
	if err := o.check(be); err != nil {
		return nil, err
	}
	cfg, err := model.LoadConfig(dir)
	if err != nil {
		return nil, err
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
	if fp8 && o.Weights != WeightsFP8 {
		return nil, fmt.Errorf("%w: %s holds FP8 weights (F8_E4M3 with weight_scale: compressed-tensors or ModelOpt FP8): load it with --weights fp8", ErrInput, dir)
	}
	m, err := newModel(cfg, w, be, o, fp8)
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
	return newModel(cfg, w, be, LoadOptions{}, false)
}

// newModel is New with the load options o; fp8: w is an FP8 checkpoint
// (fp8Checkpoint), checked as one.
func newModel(cfg *model.Config, w *model.Weights, be compute.Backend, o LoadOptions, fp8 bool) (*Model, error) {
	check := w.Check
	if fp8 {
		check = func(cfg *model.Config) error { return checkFP8Checkpoint(cfg, w) }
	}
	if err := check(cfg); err != nil {
		return nil, err
	}
	d, err := decoder.New(cfg, be, func(name string) (compute.Tensor, compute.Tensor, error) {
		t, err := bindWeight(be, w, name, o)
		return t, nil, err
	})
	if err != nil {
		return nil, err
	}
	return &Model{Cfg: cfg, d: d, be: be}, nil
}

// Forward runs the decoder over one packed batch and returns each position's
// top-k: ids (n,k) and log-probs (n,k), n the total tokens. samples must be
// valid (see Validate); temperature scales the logits (1: none).
func (m *Model) Forward(samples [][]int32, k int, temperature float32) (ids []int32, logprobs []float32) {
	return m.d.TopK(samples, k, temperature)
}

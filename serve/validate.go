package serve

import (
	"encoding/json"
	"fmt"
	"math"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"distill/cache"
	pb "distill/proto/distill/v1"
)

// Limits are what a request is validated against: the model's vocabulary
// and positions, the token budget of a forward pass and the k range.
type Limits struct {
	// VocabSize is the model's V: ids must be in [0, V).
	VocabSize int
	// MaxLen is the longest sample: min(max_position_embeddings, token budget).
	MaxLen int
	// KDefault replaces k = 0; KMax is the largest k accepted.
	KDefault, KMax int
	// MaxDraws is the most draws per position of a Score of a sampled
	// kind (the device memory is planned for it: teacherd --max-draws).
	MaxDraws int
}

// ValidateScore checks one Score request; the status names the sample (by
// its id), the position and the limit broken.
func ValidateScore(r *pb.ScoreRequest, lim Limits) error {
	if r == nil {
		return status.Error(codes.InvalidArgument, "empty request")
	}
	if err := validateK(r.K, lim); err != nil {
		return status.Errorf(codes.InvalidArgument, "sample id %d: %v", r.GetId(), err)
	}
	if err := validateTemperature(r.GetTemperature()); err != nil {
		return status.Errorf(codes.InvalidArgument, "sample id %d: %v", r.GetId(), err)
	}
	toks := r.GetTokens()
	switch {
	case len(toks) == 0:
		return status.Errorf(codes.InvalidArgument, "sample id %d is empty: send at least one token id", r.GetId())
	case len(toks) > lim.MaxLen:
		return status.Errorf(codes.InvalidArgument, "sample id %d has %d tokens, more than the daemon's limit %d (min of max_position_embeddings and the token budget): truncate it or raise --token-budget", r.GetId(), len(toks), lim.MaxLen)
	}
	for p, id := range toks {
		if id < 0 || int(id) >= lim.VocabSize {
			return status.Errorf(codes.InvalidArgument, "sample id %d position %d: token id %d out of range [0, %d) (the model's vocab size)", r.GetId(), p, id, lim.VocabSize)
		}
	}
	return validateScoreTargets(r, lim)
}

// validateScoreTargets checks a Score request's target kind, its draws
// and their key.
func validateScoreTargets(r *pb.ScoreRequest, lim Limits) error {
	kind, err := cache.ParseTargets(r.GetTargets())
	if err != nil {
		return status.Errorf(codes.InvalidArgument, "sample id %d: targets %q: want topk, sampled or head+sampled", r.GetId(), r.GetTargets())
	}
	n := r.GetSamples()
	switch {
	case kind == cache.TargetsTopK && (n != 0 || r.GetDatasetFingerprint() != "" || r.GetSampleIndex() != 0):
		return status.Errorf(codes.InvalidArgument, "sample id %d: samples %d, dataset_fingerprint %q, sample_index %d with targets topk: draws and their key belong to targets sampled or head+sampled",
			r.GetId(), n, r.GetDatasetFingerprint(), r.GetSampleIndex())
	case kind == cache.TargetsTopK:
		return nil
	case n < 1 || int(n) > lim.MaxDraws:
		return status.Errorf(codes.InvalidArgument, "sample id %d: samples %d with targets %s: want 1 to %d draws per position (the daemon plans its device memory for %d: teacherd --max-draws)",
			r.GetId(), n, kind, lim.MaxDraws, lim.MaxDraws)
	case r.GetDatasetFingerprint() == "":
		return status.Errorf(codes.InvalidArgument, "sample id %d: targets %s without dataset_fingerprint: the draws are keyed by the dataset's fingerprint and the sample's index, as a fill's (DescribeDataset gives the fingerprint)", r.GetId(), kind)
	case r.GetSampleIndex() < 0:
		return status.Errorf(codes.InvalidArgument, "sample id %d: sample_index %d: want the sample's index in the dataset (>= 0)", r.GetId(), r.GetSampleIndex())
	}
	return nil
}

func validateK(kp *int32, lim Limits) error {
	if kp == nil {
		return nil // absent: KDefault
	}
	if k := *kp; k <= 0 || int(k) > lim.KMax || int(k) > lim.VocabSize {
		return fmt.Errorf("k=%d out of range: want 1..%d (leave k unset for the default %d)", k, min(lim.KMax, lim.VocabSize), lim.KDefault)
	}
	return nil
}

func validateTemperature(t float32) error {
	if t == 0 {
		return nil // 1
	}
	if !(t > 0) || math.IsInf(float64(t), 0) {
		return fmt.Errorf("temperature %v must be a positive finite number (0 means 1)", t)
	}
	return nil
}

// ValidateDataset checks a dataset spec for what can be checked without
// opening files.
func ValidateDataset(d *pb.Dataset) error {
	if d == nil || len(d.GetSources()) == 0 {
		return status.Error(codes.InvalidArgument, "dataset: no sources: give at least one file path")
	}
	for i, s := range d.GetSources() {
		if s.GetPath() == "" {
			return status.Errorf(codes.InvalidArgument, "dataset source %d: empty path", i)
		}
		if w := s.GetWeight(); w < 0 || math.IsNaN(w) || math.IsInf(w, 0) {
			return status.Errorf(codes.InvalidArgument, "dataset source %d (%s): weight %v must be a finite number >= 0", i, s.GetPath(), w)
		}
		switch s.GetFormat() {
		case "", "jsonl", "csv", "parquet":
		default:
			return status.Errorf(codes.InvalidArgument, "dataset source %d (%s): format %q: want jsonl, csv or parquet (or empty: from the extension)", i, s.GetPath(), s.GetFormat())
		}
		if err := columnMap(s.GetColumns()).Check(); err != nil {
			return status.Errorf(codes.InvalidArgument, "dataset source %d (%s): columns: %v", i, s.GetPath(), err)
		}
	}
	if d.GetMaxLen() < 0 {
		return status.Errorf(codes.InvalidArgument, "dataset max_len %d must be >= 0", d.GetMaxLen())
	}
	if d.GetNumSamples() < 0 {
		return status.Errorf(codes.InvalidArgument, "dataset num_samples %d must be >= 0", d.GetNumSamples())
	}
	switch d.GetPolicy() {
	case "", "truncate", "drop":
	default:
		return status.Errorf(codes.InvalidArgument, "dataset policy %q: want truncate or drop", d.GetPolicy())
	}
	if v := d.GetTemplateVarsJson(); v != "" {
		var m map[string]any
		if err := json.Unmarshal([]byte(v), &m); err != nil {
			return status.Errorf(codes.InvalidArgument, "dataset template_vars_json: not a JSON object: %v", err)
		}
	}
	return nil
}

// ValidateFill checks a Fill request for what can be checked without
// opening the dataset (the range against its length is checked after).
func ValidateFill(r *pb.FillRequest, lim Limits) error {
	if r == nil {
		return status.Error(codes.InvalidArgument, "empty request")
	}
	if err := ValidateDataset(r.GetDataset()); err != nil {
		return err
	}
	if r.GetStart() < 0 || r.GetEnd() <= r.GetStart() {
		return status.Errorf(codes.InvalidArgument, "range [%d, %d): want 0 <= start < end", r.GetStart(), r.GetEnd())
	}
	if c := r.GetChunkSamples(); c < 0 || c > cache.MaxChunkSamples {
		return status.Errorf(codes.InvalidArgument, "chunk_samples %d: want 1..%d (0 means %d)", c, cache.MaxChunkSamples, DefaultChunkSamples)
	}
	if err := validateK(r.K, lim); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	if err := validateTemperature(r.GetTemperature()); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	switch r.GetEncoding() {
	case "", string(cache.EncodingCompact), string(cache.EncodingLossless):
	default:
		return status.Errorf(codes.InvalidArgument, "encoding %q: want %q or %q", r.GetEncoding(), cache.EncodingCompact, cache.EncodingLossless)
	}
	return validateTargets(r.GetTargets(), r.GetSamples())
}

// CheckTargets is validateTargets for cachectl fill, before it loads
// anything: the error names the flags.
func CheckTargets(targets string, samples int, k int) error {
	if samples < 0 || samples > cache.MaxDraws {
		return fmt.Errorf("--samples %d: want 1 to %d draws per position (cache.MaxDraws: a forward holds tokens x draws uniforms)", samples, cache.MaxDraws)
	}
	if err := validateTargets(targets, int32(samples)); err != nil {
		return fmt.Errorf("--targets %s --samples %d: %s", targets, samples, status.Convert(err).Message())
	}
	if t, _ := cache.ParseTargets(targets); t == cache.TargetsSampled && k != 0 {
		return fmt.Errorf("--k %d with --targets sampled: a sampled cache has no top-k head; use --targets head+sampled --k %d for an exact head plus draws", k, k)
	}
	return nil
}

// validateTargets checks a fill's target kind and draws (the flags
// --targets and --samples of cachectl fill).
func validateTargets(targets string, samples int32) error {
	kind, err := cache.ParseTargets(targets)
	if err != nil {
		return status.Errorf(codes.InvalidArgument, "targets %q: want topk, sampled or head+sampled (--targets)", targets)
	}
	switch {
	case kind == cache.TargetsTopK && samples != 0:
		return status.Errorf(codes.InvalidArgument, "samples %d with targets topk: draws belong to targets sampled or head+sampled (--targets)", samples)
	case kind != cache.TargetsTopK && (samples < 1 || samples > cache.MaxDraws):
		return status.Errorf(codes.InvalidArgument, "samples %d with targets %s: want 1 to %d draws per position (--samples; the bound is cache.MaxDraws: a forward holds tokens x draws uniforms)", samples, kind, cache.MaxDraws)
	}
	return nil
}

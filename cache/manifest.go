package cache

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
)

// Sentinel errors. Every error returned by this package wraps one of them
// (or an I/O error from the FS) with %w and a message naming the cache
// directory, chunk, sample or field involved.
var (
	// ErrCorrupt marks on-disk state that does not match what the index or
	// the format promises: a checksum or row count mismatch, a missing or
	// truncated chunk, an unparsable index record.
	ErrCorrupt = errors.New("cache: corrupt")
	// ErrManifestMismatch marks two manifests (an existing cache and the one
	// a writer asked for, or two directories opened as one cache) that
	// disagree on a field.
	ErrManifestMismatch = errors.New("cache: manifest mismatch")
	// ErrInvalid marks bad caller input: a malformed sample, a range outside
	// [0, Samples), an out-of-order Add.
	ErrInvalid = errors.New("cache: invalid input")
	// ErrRangeDone is returned by BeginChunk for a range that is already
	// committed; a fill treats it as "skip", which makes re-filling a no-op.
	ErrRangeDone = errors.New("cache: range already done")
	// ErrRangeBusy is returned by BeginChunk for a range that overlaps one
	// a live writer is computing now (its claim; the error is a
	// *BusyError naming the holder). A fill does its other ranges and
	// tries this one again later: by then it is done, or free.
	ErrRangeBusy = errors.New("cache: range busy")
	// ErrNotFound is returned for a sample whose range is not committed
	// (yet), or outside the cache's samples; the message names the sample.
	ErrNotFound = errors.New("cache: not found")
	// ErrLocked is returned when the index lock cannot be taken within
	// Options.LockTimeout (another process holds it for too long).
	ErrLocked = errors.New("cache: index locked")
	// ErrNotCache is returned when a directory holds no cache index.
	ErrNotCache = errors.New("cache: not a cache directory")
	// ErrIndexLost is returned for a directory whose chunks/ holds files
	// but which has no index/: its index was deleted or not copied with
	// the chunks. A writer refuses it (its GC would remove every chunk
	// file), and so does a reset without force.
	ErrIndexLost = errors.New("cache: index lost")
	// ErrCommitted is returned by Reset for a cache that holds committed
	// chunks when it was not told to discard them.
	ErrCommitted = errors.New("cache: committed chunks present")
)

// Encoding selects how top-k log-probs are stored (token ids are always
// stored losslessly). See the package doc for the decode formulas.
type Encoding string

const (
	// EncodingCompact quantizes log-probs: the top-1 to 1/4096 nat, the
	// others as closed-loop deltas to 1/64 nat (|error| <= 1/128 nat).
	EncodingCompact Encoding = "compact"
	// EncodingLossless stores the float32 log-probs bit for bit.
	EncodingLossless Encoding = "lossless"
)

// FormatVersion is the on-disk format version of a top-k cache
// (Manifest.Targets topk), and FormatVersionSampled that of the sampled
// kinds, which added the draw columns (package doc). A top-k cache is still
// written as version 1, byte for byte as before version 2 existed, so
// older builds read it. Any change to the key layout, chunk schema, or a
// constant marked "format" in the package doc needs a bump.
const (
	FormatVersion        = 1
	FormatVersionSampled = 2
)

// Targets is the kind of teacher targets a cache holds per position
// (Manifest.Targets; package doc, What is stored).
type Targets string

// Target kinds. The empty string in a manifest is TargetsTopK (version 1
// manifests have no targets field).
const (
	// TargetsTopK: the teacher's top-K ids and log-probs.
	TargetsTopK Targets = "topk"
	// TargetsSampled: N draws from the teacher's full distribution, as
	// distinct ids and counts; the target is count/N.
	TargetsSampled Targets = "sampled"
	// TargetsHeadSampled: the exact top-K (the head) plus N draws from the
	// distribution outside it renormalized, with its mass (TailMass); the
	// target is p on the head and TailMass·count/N on the drawn ids.
	TargetsHeadSampled Targets = "head+sampled"
)

// MaxDraws bounds Manifest.Draws: a fill holds tokens x N uniforms (8192
// x 4096 x 8 bytes = 256 MiB at the default token budget), and counts are
// stored as 16-bit numbers.
const MaxDraws = 4096

// ParseTargets parses a target kind as the flags and configs spell it;
// "" is topk.
func ParseTargets(s string) (Targets, error) {
	switch Targets(s) {
	case "", TargetsTopK:
		return TargetsTopK, nil
	case TargetsSampled, TargetsHeadSampled:
		return Targets(s), nil
	}
	return "", fmt.Errorf("%w: targets %q: want topk, sampled or head+sampled", ErrInvalid, s)
}

// Kind is m's target kind, TargetsTopK for a manifest without one.
func (m *Manifest) Kind() Targets {
	if m.Targets == "" {
		return TargetsTopK
	}
	return m.Targets
}

// Sampled reports whether m's positions carry draws (sampled or
// head+sampled).
func (m *Manifest) Sampled() bool { return m.Kind() != TargetsTopK }

// VersionFor is the format version of a cache of kind t.
func VersionFor(t Targets) int {
	if t == "" || t == TargetsTopK {
		return FormatVersion
	}
	return FormatVersionSampled
}

// normalize spells a top-k manifest as version 1 does (no targets field)
// and fills in the format version when unset.
func (m *Manifest) normalize() {
	if m.Targets == TargetsTopK {
		m.Targets = ""
	}
	if m.FormatVersion == 0 {
		m.FormatVersion = VersionFor(m.Targets)
	}
}

// entryWidth bounds the (position, id) entries of one position: k, plus
// the draws of a sampled kind.
func (m *Manifest) entryWidth() int { return m.K + m.Draws }

// Manifest describes a cache: what produced it and what every chunk holds.
// Two caches (or a writer and an existing cache) are compatible only if all
// fields agree; see Manifest.Agree.
type Manifest struct {
	// FormatVersion is the on-disk format version; Create fills it in.
	FormatVersion int `json:"format_version"`
	// TeacherFingerprint identifies the teacher (config + weights hash).
	TeacherFingerprint string `json:"teacher_fingerprint"`
	// TokenizerFingerprint identifies the tokenizer used for input_ids.
	TokenizerFingerprint string `json:"tokenizer_fingerprint"`
	// DatasetFingerprint identifies the tokenized dataset the sample
	// indices refer to.
	DatasetFingerprint string `json:"dataset_fingerprint"`
	// VocabSize is the teacher's vocabulary size V: ids are in [0, V) and
	// log-probs are normalized over all V.
	VocabSize int `json:"vocab_size"`
	// K is the number of top entries stored per position (the head of
	// head+sampled; 0 for sampled).
	K int `json:"k"`
	// Temperature is the capture temperature the log-probs were computed at.
	Temperature float32 `json:"temperature"`
	// Samples is the dataset's sample count; valid indices are [0, Samples).
	Samples int64 `json:"samples"`
	// Encoding is the log-prob encoding of every chunk.
	Encoding Encoding `json:"encoding"`
	// Targets is the target kind (format version 2; empty: topk).
	Targets Targets `json:"targets,omitempty"`
	// Draws is N, the draws per position of a sampled kind (0 for topk).
	Draws int `json:"draws,omitempty"`
}

// Validate reports the first field that makes m unusable, with a hint.
func (m *Manifest) Validate() error {
	if _, err := ParseTargets(string(m.Targets)); err != nil {
		return fmt.Errorf("%w: manifest targets %q: want topk, sampled or head+sampled (a newer build may know it)", ErrInvalid, m.Targets)
	}
	switch {
	case m.FormatVersion != FormatVersion && m.FormatVersion != FormatVersionSampled:
		return fmt.Errorf("%w: manifest format_version %d, this build reads %d and %d (rebuild the cache or use a matching build)", ErrInvalid, m.FormatVersion, FormatVersion, FormatVersionSampled)
	case m.FormatVersion != VersionFor(m.Targets):
		return fmt.Errorf("%w: manifest format_version %d with targets %s: a %s cache is format version %d", ErrInvalid, m.FormatVersion, m.Kind(), m.Kind(), VersionFor(m.Targets))
	case m.VocabSize <= 0 || m.VocabSize > 1<<24:
		return fmt.Errorf("%w: manifest vocab_size %d out of range [1, %d]", ErrInvalid, m.VocabSize, 1<<24)
	case m.Kind() == TargetsSampled && m.K != 0:
		return fmt.Errorf("%w: manifest k %d with targets sampled: a sampled cache has no top-k head (k 0); use targets head+sampled for a head", ErrInvalid, m.K)
	case m.Sampled() && (m.Draws < 1 || m.Draws > MaxDraws):
		return fmt.Errorf("%w: manifest draws %d with targets %s: want 1 to %d (cache.MaxDraws: a fill holds tokens x N uniforms)", ErrInvalid, m.Draws, m.Kind(), MaxDraws)
	case !m.Sampled() && m.Draws != 0:
		return fmt.Errorf("%w: manifest draws %d with targets topk: draws belong to targets sampled or head+sampled", ErrInvalid, m.Draws)
	case m.Kind() != TargetsSampled && (m.K <= 0 || m.K > m.VocabSize):
		return fmt.Errorf("%w: manifest k %d must be in [1, vocab_size %d]", ErrInvalid, m.K, m.VocabSize)
	case m.K > maxK:
		return fmt.Errorf("%w: manifest k %d exceeds the format limit %d", ErrInvalid, m.K, maxK)
	case !(m.Temperature > 0) || math.IsInf(float64(m.Temperature), 0):
		return fmt.Errorf("%w: manifest temperature %v must be a positive finite number", ErrInvalid, m.Temperature)
	case m.Samples <= 0:
		return fmt.Errorf("%w: manifest samples %d must be positive", ErrInvalid, m.Samples)
	case m.Encoding != EncodingCompact && m.Encoding != EncodingLossless:
		return fmt.Errorf("%w: manifest encoding %q: want %q or %q", ErrInvalid, m.Encoding, EncodingCompact, EncodingLossless)
	case m.TeacherFingerprint == "" || m.TokenizerFingerprint == "" || m.DatasetFingerprint == "":
		return fmt.Errorf("%w: manifest fingerprints (teacher %q, tokenizer %q, dataset %q) must all be set", ErrInvalid, m.TeacherFingerprint, m.TokenizerFingerprint, m.DatasetFingerprint)
	}
	return nil
}

// Agree returns nil if o describes the same cache as m, or an error wrapping
// ErrManifestMismatch that names the first differing field and both values.
// whatM and whatO name the two sides in the message (e.g. directories).
func (m *Manifest) Agree(o *Manifest, whatM, whatO string) error {
	type field struct {
		name string
		a, b any
	}
	fields := []field{
		{"format_version", m.FormatVersion, o.FormatVersion},
		{"tokenizer_fingerprint", m.TokenizerFingerprint, o.TokenizerFingerprint},
		{"vocab_size", m.VocabSize, o.VocabSize},
		{"k", m.K, o.K},
		{"teacher_fingerprint", m.TeacherFingerprint, o.TeacherFingerprint},
		{"dataset_fingerprint", m.DatasetFingerprint, o.DatasetFingerprint},
		{"temperature", m.Temperature, o.Temperature},
		{"samples", m.Samples, o.Samples},
		{"encoding", m.Encoding, o.Encoding},
		{"targets", m.Kind(), o.Kind()},
		{"draws", m.Draws, o.Draws},
	}
	for _, f := range fields {
		if f.a != f.b {
			return fmt.Errorf("%w: field %s differs: %v in %s, %v in %s", ErrManifestMismatch, f.name, f.a, whatM, f.b, whatO)
		}
	}
	return nil
}

func (m *Manifest) marshal() []byte {
	b, err := json.Marshal(m)
	if err != nil {
		panic(err) // plain struct of strings and numbers: cannot fail
	}
	return b
}

func unmarshalManifest(b []byte) (Manifest, error) {
	var m Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return m, fmt.Errorf("%w: manifest record: %v", ErrCorrupt, err)
	}
	return m, nil
}

// Sample is one cached sample. T = len(Tokens); TopKIDs and TopKLogProbs
// are (T, K) row-major: entry [t*K+j] is the j-th most likely next token
// after reading Tokens[0..t], i.e. a prediction of Tokens[t+1].
type Sample struct {
	// Index is the sample's index in the dataset, in [0, Manifest.Samples).
	Index int64
	// Tokens are the input ids, (T).
	Tokens []int32
	// Mask is the loss mask, (T): 1 where token t is a training target.
	Mask []uint8
	// TopKIDs are the teacher's top-k token ids per position, (T, K),
	// sorted by descending probability.
	TopKIDs []int32
	// TopKLogProbs are the matching log-probs normalized over the full
	// vocabulary, (T, K), non-increasing along K.
	TopKLogProbs []float32

	// The draws of a sampled kind (Manifest.Targets sampled or
	// head+sampled; nil for topk). DrawN (T) is the number of distinct ids
	// drawn at each position; DrawIDs and DrawCounts (Σ DrawN) are those
	// ids and how many of the N draws fell on each, position after
	// position, by descending count (ties: ascending id), each count >= 1
	// and a position's counts summing to N.
	DrawN      []int32
	DrawIDs    []int32
	DrawCounts []int32
	// TailMass (T), head+sampled only: the teacher's probability outside
	// the head, which the draws split (the target of drawn id v is
	// TailMass·count_v/N).
	TailMass []float32
}

// Range is a half-open range of sample indices [Start, End).
type Range struct {
	Start, End int64
}

// Len returns End - Start.
func (r Range) Len() int64 { return r.End - r.Start }

// String formats r as "[start, end)".
func (r Range) String() string { return fmt.Sprintf("[%d, %d)", r.Start, r.End) }

// ChunkInfo is the index record of one committed chunk.
type ChunkInfo struct {
	Range
	// File is the chunk's file name inside the chunks/ directory.
	File string `json:"file"`
	// Bytes is the chunk file size.
	Bytes int64 `json:"bytes"`
	// CRC32C is the Castagnoli CRC-32 of the whole chunk file.
	CRC32C uint32 `json:"crc32c"`
	// Tokens is the total number of positions in the chunk.
	Tokens int64 `json:"tokens"`
}

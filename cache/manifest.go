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
	// ErrNotFound is returned for a sample whose range is not committed (yet).
	ErrNotFound = errors.New("cache: sample not in cache")
	// ErrLocked is returned when the index lock cannot be taken within
	// Options.LockTimeout (another process holds it for too long).
	ErrLocked = errors.New("cache: index locked")
	// ErrNotCache is returned when a directory holds no cache index.
	ErrNotCache = errors.New("cache: not a cache directory")
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

// FormatVersion is the on-disk format version written by this package. Any
// change to the key layout, chunk schema, or a constant marked "format" in
// the package doc needs a bump.
const FormatVersion = 1

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
	// K is the number of top entries stored per position.
	K int `json:"k"`
	// Temperature is the capture temperature the log-probs were computed at.
	Temperature float32 `json:"temperature"`
	// Samples is the dataset's sample count; valid indices are [0, Samples).
	Samples int64 `json:"samples"`
	// Encoding is the log-prob encoding of every chunk.
	Encoding Encoding `json:"encoding"`
}

// Validate reports the first field that makes m unusable, with a hint.
func (m *Manifest) Validate() error {
	switch {
	case m.FormatVersion != FormatVersion:
		return fmt.Errorf("%w: manifest format_version %d, this build reads %d (rebuild the cache or use a matching build)", ErrInvalid, m.FormatVersion, FormatVersion)
	case m.VocabSize <= 0 || m.VocabSize > 1<<24:
		return fmt.Errorf("%w: manifest vocab_size %d out of range [1, %d]", ErrInvalid, m.VocabSize, 1<<24)
	case m.K <= 0 || m.K > m.VocabSize:
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

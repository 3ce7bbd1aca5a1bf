package cache

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"sort"
	"strconv"

	"github.com/apache/arrow/go/v17/arrow"
	"github.com/apache/arrow/go/v17/arrow/array"
	"github.com/apache/arrow/go/v17/arrow/ipc"
	"github.com/apache/arrow/go/v17/arrow/memory"
)

// Format constants of the compact encoding (changing any needs a
// FormatVersion bump): lp[t,0] = -lp_top[t]/lpTopScale and each further
// entry steps down by delta*lpDeltaUnit/lpTopScale.
const (
	lpTopScale  = 4096 // format: units per nat of lp_top
	lpDeltaUnit = 64   // format: lp_top units per delta unit (1/64 nat)
	maxK        = 1 << 12
)

// Column names of a chunk file (format).
const (
	colIndex    = "index"
	colInputIDs = "input_ids"
	colLossMask = "loss_mask"
	colIDDict   = "id_dict"
	colIDCode0  = "id_code0"
	colIDCode1  = "id_code1"
	colIDCode2  = "id_code2"
	colLPTop    = "lp_top"
	colLPDelta0 = "lp_delta0"
	colLPDelta1 = "lp_delta1"
	colLPBits0  = "lp_bits0"
	colLPBits1  = "lp_bits1"
	colLPBits2  = "lp_bits2"
	colLPBits3  = "lp_bits3"
	// Format version 2 (sampled kinds).
	colDrawN      = "draw_n"
	colDrawCode0  = "draw_code0"
	colDrawCode1  = "draw_code1"
	colDrawCode2  = "draw_code2"
	colDrawCount0 = "draw_count0"
	colDrawCount1 = "draw_count1"
	colTailBits0  = "tail_bits0"
	colTailBits1  = "tail_bits1"
	colTailBits2  = "tail_bits2"
	colTailBits3  = "tail_bits3"
)

// Schema metadata keys of a chunk file (format).
const (
	metaVersion  = "distill.format_version"
	metaEncoding = "distill.encoding"
	metaK        = "distill.k"
	metaVocab    = "distill.vocab_size"
	metaStart    = "distill.range_start"
	metaEnd      = "distill.range_end"
	// Format version 2.
	metaTargets = "distill.targets"
	metaDraws   = "distill.draws"
)

// chunkSchema is the schema of m's chunks: a top-k manifest's is version
// 1's, column for column; the sampled kinds add the draw columns (and
// sampled, with no head, has no id codes or log-probs).
func chunkSchema(m *Manifest, r Range) *arrow.Schema {
	u8 := arrow.ListOf(arrow.PrimitiveTypes.Uint8)
	fields := []arrow.Field{
		{Name: colIndex, Type: arrow.PrimitiveTypes.Int64},
		{Name: colInputIDs, Type: arrow.ListOf(arrow.PrimitiveTypes.Int32)},
		{Name: colLossMask, Type: u8},
		{Name: colIDDict, Type: arrow.ListOf(arrow.PrimitiveTypes.Int32)},
	}
	plain := func(names ...string) {
		for _, n := range names {
			fields = append(fields, arrow.Field{Name: n, Type: u8})
		}
	}
	if m.K > 0 {
		plain(colIDCode0, colIDCode1, colIDCode2)
		if m.Encoding == EncodingCompact {
			fields = append(fields, arrow.Field{Name: colLPTop, Type: arrow.ListOf(arrow.PrimitiveTypes.Uint16)})
			plain(colLPDelta0, colLPDelta1)
		} else {
			plain(colLPBits0, colLPBits1, colLPBits2, colLPBits3)
		}
	}
	keys := []string{metaVersion, metaEncoding, metaK, metaVocab, metaStart, metaEnd}
	vals := []string{strconv.Itoa(m.FormatVersion), string(m.Encoding), strconv.Itoa(m.K),
		strconv.Itoa(m.VocabSize), strconv.FormatInt(r.Start, 10), strconv.FormatInt(r.End, 10)}
	if m.Sampled() {
		fields = append(fields, arrow.Field{Name: colDrawN, Type: arrow.ListOf(arrow.PrimitiveTypes.Uint16)})
		plain(colDrawCode0, colDrawCode1, colDrawCode2, colDrawCount0, colDrawCount1)
		if m.Kind() == TargetsHeadSampled {
			plain(colTailBits0, colTailBits1, colTailBits2, colTailBits3)
		}
		keys = append(keys, metaTargets, metaDraws)
		vals = append(vals, string(m.Kind()), strconv.Itoa(m.Draws))
	}
	md := arrow.NewMetadata(keys, vals)
	return arrow.NewSchema(fields, &md)
}

// validateSample checks s against m; the error names the sample, position
// and slot at fault.
func validateSample(m *Manifest, s *Sample) error {
	T, K := len(s.Tokens), m.K
	where := fmt.Sprintf("sample %d", s.Index)
	// T == 0 is allowed: it records a dataset record that the data layer
	// dropped or skipped, so cache indexes stay the dataset's.
	if len(s.Mask) != T {
		return fmt.Errorf("%w: %s: loss mask has %d entries, tokens %d", ErrInvalid, where, len(s.Mask), T)
	}
	if len(s.TopKIDs) != T*K || len(s.TopKLogProbs) != T*K {
		return fmt.Errorf("%w: %s: top-k ids %d and log-probs %d entries, want T*K = %d*%d = %d", ErrInvalid, where, len(s.TopKIDs), len(s.TopKLogProbs), T, K, T*K)
	}
	V := int32(m.VocabSize)
	for t, tok := range s.Tokens {
		if tok < 0 || tok >= V {
			return fmt.Errorf("%w: %s: token %d at position %d outside vocab [0, %d)", ErrInvalid, where, tok, t, V)
		}
		if s.Mask[t] > 1 {
			return fmt.Errorf("%w: %s: loss mask %d at position %d, want 0 or 1", ErrInvalid, where, s.Mask[t], t)
		}
	}
	for t := 0; t < T; t++ {
		ids, lps := s.TopKIDs[t*K:(t+1)*K], s.TopKLogProbs[t*K:(t+1)*K]
		mass := 0.0
		for j := range ids {
			if ids[j] < 0 || ids[j] >= V {
				return fmt.Errorf("%w: %s: position %d slot %d: token id %d outside vocab [0, %d)", ErrInvalid, where, t, j, ids[j], V)
			}
			for i := 0; i < j; i++ { // K is small; a set would cost more
				if ids[i] == ids[j] {
					return fmt.Errorf("%w: %s: position %d: token id %d appears in slots %d and %d", ErrInvalid, where, t, ids[j], i, j)
				}
			}
			lp := lps[j]
			if math.IsNaN(float64(lp)) || lp > 1e-3 {
				return fmt.Errorf("%w: %s: position %d slot %d: log-prob %v is not a log-probability (NaN or > 0)", ErrInvalid, where, t, j, lp)
			}
			if j > 0 && lp > lps[j-1] {
				return fmt.Errorf("%w: %s: position %d: log-probs not sorted descending (slot %d: %v > slot %d: %v)", ErrInvalid, where, t, j, lp, j-1, lps[j-1])
			}
			mass += math.Exp(float64(lp))
		}
		if mass > 1+1e-3 {
			return fmt.Errorf("%w: %s: position %d: top-k probabilities sum to %.6f > 1; log-probs must be normalized over the full vocabulary", ErrInvalid, where, t, mass)
		}
		if K > 0 && m.Encoding == EncodingCompact && float64(lps[0])*lpTopScale < -math.MaxUint16 {
			return fmt.Errorf("%w: %s: position %d: top-1 log-prob %v below %v; impossible for a distribution over the vocabulary", ErrInvalid, where, t, lps[0], -float64(math.MaxUint16)/lpTopScale)
		}
	}
	return validateDraws(m, s, where)
}

// validateDraws checks the draws of a sampled kind (none for topk).
func validateDraws(m *Manifest, s *Sample, where string) error {
	T, K, V := len(s.Tokens), m.K, int32(m.VocabSize)
	if !m.Sampled() {
		if s.DrawN != nil || s.DrawIDs != nil || s.DrawCounts != nil || s.TailMass != nil {
			return fmt.Errorf("%w: %s: draws in a topk cache: fill it with targets sampled or head+sampled", ErrInvalid, where)
		}
		return nil
	}
	if len(s.DrawN) != T {
		return fmt.Errorf("%w: %s: draw_n has %d entries, tokens %d", ErrInvalid, where, len(s.DrawN), T)
	}
	head := m.Kind() == TargetsHeadSampled
	if head && len(s.TailMass) != T || !head && len(s.TailMass) != 0 {
		return fmt.Errorf("%w: %s: tail mass has %d entries, want %d (targets %s)", ErrInvalid, where, len(s.TailMass), T*btoi(head), m.Kind())
	}
	total := 0
	for _, n := range s.DrawN {
		if n < 0 || int(n) > m.Draws {
			return fmt.Errorf("%w: %s: %d distinct drawn ids at a position, want 0 to the draws %d", ErrInvalid, where, n, m.Draws)
		}
		total += int(n)
	}
	if len(s.DrawIDs) != total || len(s.DrawCounts) != total {
		return fmt.Errorf("%w: %s: %d drawn ids and %d counts, want the sum of draw_n %d", ErrInvalid, where, len(s.DrawIDs), len(s.DrawCounts), total)
	}
	off := 0
	seen := map[int32]int{}
	for t := 0; t < T; t++ {
		n := int(s.DrawN[t])
		ids, counts := s.DrawIDs[off:off+n], s.DrawCounts[off:off+n]
		off += n
		sum := 0
		clear(seen)
		for j, id := range ids {
			if id < 0 || id >= V {
				return fmt.Errorf("%w: %s: position %d draw %d: token id %d outside vocab [0, %d)", ErrInvalid, where, t, j, id, V)
			}
			if i, dup := seen[id]; dup {
				return fmt.Errorf("%w: %s: position %d: drawn id %d listed twice (entries %d and %d)", ErrInvalid, where, t, id, i, j)
			}
			seen[id] = j
			c := counts[j]
			if c < 1 {
				return fmt.Errorf("%w: %s: position %d: id %d has count %d, want >= 1 (ids drawn no time are not stored)", ErrInvalid, where, t, id, c)
			}
			if j > 0 && (c > counts[j-1] || c == counts[j-1] && id <= ids[j-1]) {
				return fmt.Errorf("%w: %s: position %d: draws not in the stored order (descending count, ties ascending id) at %d: id %d count %d after id %d count %d", ErrInvalid, where, t, j, id, c, ids[j-1], counts[j-1])
			}
			for i := 0; i < K; i++ {
				if s.TopKIDs[t*K+i] == id {
					return fmt.Errorf("%w: %s: position %d: drawn id %d is in the head (slot %d): the draws are from outside it", ErrInvalid, where, t, id, i)
				}
			}
			sum += int(c)
		}
		tail := float32(1)
		if head {
			tail = s.TailMass[t]
			if !(tail >= 0 && tail <= 1) {
				return fmt.Errorf("%w: %s: position %d: tail mass %v outside [0, 1]", ErrInvalid, where, t, tail)
			}
		}
		switch {
		case n == 0 && tail == 0:
		case sum != m.Draws:
			return fmt.Errorf("%w: %s: position %d: counts sum to %d, want the draws %d (none only where the tail mass is 0)", ErrInvalid, where, t, sum, m.Draws)
		}
	}
	return nil
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// countWriter is the io.WriteSeeker the Arrow file writer wants (it only
// asks for the current offset) over a bytes.Buffer.
type countWriter struct{ buf bytes.Buffer }

func (w *countWriter) Write(p []byte) (int, error) { return w.buf.Write(p) }
func (w *countWriter) Seek(off int64, whence int) (int64, error) {
	if off != 0 || whence != io.SeekCurrent {
		return 0, errors.New("cache: countWriter only reports its offset")
	}
	return int64(w.buf.Len()), nil
}

// encodeChunk encodes validated samples (indices r.Start.. in order) as an
// Arrow IPC file with zstd-compressed buffers.
func encodeChunk(m *Manifest, r Range, samples []Sample) ([]byte, error) {
	var positions int64
	for i := range samples {
		positions += int64(len(samples[i].Tokens))
		if err := checkEntries(r, samples[i].Index, positions, m.entryWidth()); err != nil {
			return nil, err // ChunkWriter.Add refuses it first; a guard for other callers
		}
	}
	dict, code := chunkDict(m.VocabSize, samples)
	schema := chunkSchema(m, r)
	cb := &chunkBuilder{b: array.NewRecordBuilder(memory.DefaultAllocator, schema), schema: schema, code: code}
	defer cb.b.Release()
	for i := range samples {
		s := &samples[i]
		cb.b.Field(0).(*array.Int64Builder).Append(s.Index)
		cb.list(colInputIDs).Append(true)
		cb.list(colInputIDs).ValueBuilder().(*array.Int32Builder).AppendValues(s.Tokens, nil)
		cb.u8(colLossMask, s.Mask)
		cb.list(colIDDict).Append(true)
		if i == 0 {
			cb.list(colIDDict).ValueBuilder().(*array.Int32Builder).AppendValues(dict, nil)
		}
		cb.head(m, s)
		if m.Sampled() {
			cb.draws(m, s)
		}
	}
	return writeChunkIPC(cb.b, schema, r)
}

// chunkDict is a chunk's id dictionary: its distinct top-k (and drawn)
// ids by descending count, ties by id, so that frequent ids get small
// codes and the high code planes are mostly zero; and code, id -> its
// index in dict (vocab entries).
func chunkDict(vocab int, samples []Sample) (dict, code []int32) {
	count := make([]int32, vocab)
	for i := range samples {
		for _, id := range samples[i].TopKIDs {
			count[id]++
		}
		for _, id := range samples[i].DrawIDs {
			count[id]++
		}
	}
	for id, c := range count {
		if c > 0 {
			dict = append(dict, int32(id))
		}
	}
	sort.Slice(dict, func(a, b int) bool {
		ca, cb := count[dict[a]], count[dict[b]]
		if ca != cb {
			return ca > cb
		}
		return dict[a] < dict[b]
	})
	code = count // reuse: id -> code
	for c, id := range dict {
		code[id] = int32(c)
	}
	return dict, code
}

// chunkBuilder appends samples to a chunk's record, with scratch byte
// planes reused from sample to sample.
type chunkBuilder struct {
	b                          *array.RecordBuilder
	schema                     *arrow.Schema
	code                       []int32 // id -> dictionary code
	c0, c1, c2, p0, p1, p2, p3 []uint8
	u16s                       []uint16
}

func (cb *chunkBuilder) list(name string) *array.ListBuilder {
	return cb.b.Field(cb.schema.FieldIndices(name)[0]).(*array.ListBuilder)
}

func (cb *chunkBuilder) u8(name string, v []uint8) {
	lb := cb.list(name)
	lb.Append(true)
	lb.ValueBuilder().(*array.Uint8Builder).AppendValues(v, nil)
}

func (cb *chunkBuilder) u16(name string, v []uint16) {
	lb := cb.list(name)
	lb.Append(true)
	lb.ValueBuilder().(*array.Uint16Builder).AppendValues(v, nil)
}

// codes appends the three byte planes of ids' dictionary codes.
func (cb *chunkBuilder) codes(names [3]string, ids []int32) {
	n := len(ids)
	cb.c0, cb.c1, cb.c2 = grow(cb.c0, n), grow(cb.c1, n), grow(cb.c2, n)
	for e, id := range ids {
		c := cb.code[id]
		cb.c0[e], cb.c1[e], cb.c2[e] = uint8(c), uint8(c>>8), uint8(c>>16)
	}
	cb.u8(names[0], cb.c0)
	cb.u8(names[1], cb.c1)
	cb.u8(names[2], cb.c2)
}

// floats appends the four byte planes of v's float32 bits.
func (cb *chunkBuilder) floats(names [4]string, v []float32) {
	n := len(v)
	cb.p0, cb.p1, cb.p2, cb.p3 = grow(cb.p0, n), grow(cb.p1, n), grow(cb.p2, n), grow(cb.p3, n)
	floatBits(v, cb.p0, cb.p1, cb.p2, cb.p3)
	for i, p := range [][]uint8{cb.p0, cb.p1, cb.p2, cb.p3} {
		cb.u8(names[i], p)
	}
}

// head appends a sample's top-k (none at k 0): the id codes and the
// log-probs in the manifest's encoding.
func (cb *chunkBuilder) head(m *Manifest, s *Sample) {
	K := m.K
	if K == 0 {
		return
	}
	cb.codes([3]string{colIDCode0, colIDCode1, colIDCode2}, s.TopKIDs)
	if m.Encoding != EncodingCompact {
		cb.floats([4]string{colLPBits0, colLPBits1, colLPBits2, colLPBits3}, s.TopKLogProbs)
		return
	}
	T := len(s.Tokens)
	top := grow(cb.u16s, T)
	cb.u16s = top
	nd := T * (K - 1)
	p0, p1 := grow(cb.p0, nd), grow(cb.p1, nd)
	cb.p0, cb.p1 = p0, p1
	for t := 0; t < T; t++ {
		lps := s.TopKLogProbs[t*K : (t+1)*K]
		acc := int64(math.Round(-float64(lps[0]) * lpTopScale))
		acc = min(max(acc, 0), math.MaxUint16)
		top[t] = uint16(acc)
		for j := 1; j < K; j++ {
			// Closed loop: quantize the step from the reconstructed
			// previous value, so errors do not accumulate along K.
			want := -float64(lps[j]) * lpTopScale
			// Clamp in float64 before converting: a huge finite step
			// (lp = -1e30) would overflow int64 and wrap to a small d.
			step := math.Round((want - float64(acc)) / lpDeltaUnit)
			d := int64(min(max(step, 0), math.MaxUint16)) // +Inf saturates too
			acc += d * lpDeltaUnit
			e := t*(K-1) + j - 1
			p0[e], p1[e] = uint8(d), uint8(d>>8)
		}
	}
	cb.u16(colLPTop, top)
	cb.u8(colLPDelta0, p0)
	cb.u8(colLPDelta1, p1)
}

// draws appends a sampled sample's draws: the distinct ids per position,
// their codes and counts, and head+sampled's tail mass.
func (cb *chunkBuilder) draws(m *Manifest, s *Sample) {
	dn := grow(cb.u16s, len(s.Tokens))
	cb.u16s = dn
	for t, v := range s.DrawN {
		dn[t] = uint16(v)
	}
	cb.u16(colDrawN, dn)
	cb.codes([3]string{colDrawCode0, colDrawCode1, colDrawCode2}, s.DrawIDs)
	nd := len(s.DrawIDs)
	cb.p0, cb.p1 = grow(cb.p0, nd), grow(cb.p1, nd)
	for e, c := range s.DrawCounts {
		cb.p0[e], cb.p1[e] = uint8(c), uint8(c>>8)
	}
	cb.u8(colDrawCount0, cb.p0)
	cb.u8(colDrawCount1, cb.p1)
	if m.Kind() == TargetsHeadSampled {
		cb.floats([4]string{colTailBits0, colTailBits1, colTailBits2, colTailBits3}, s.TailMass)
	}
}

// writeChunkIPC writes b's record as an Arrow IPC file, zstd-compressed
// where that saves at least 5%.
func writeChunkIPC(b *array.RecordBuilder, schema *arrow.Schema, r Range) ([]byte, error) {
	rec := b.NewRecord()
	defer rec.Release()
	var out countWriter
	w, err := ipc.NewFileWriter(&out, ipc.WithSchema(schema), ipc.WithAllocator(memory.DefaultAllocator),
		ipc.WithZstd(), ipc.WithMinSpaceSavings(0.05))
	if err != nil {
		return nil, fmt.Errorf("cache: arrow writer for chunk %v: %w", r, err)
	}
	if err := w.Write(rec); err != nil {
		return nil, fmt.Errorf("cache: encoding chunk %v: %w", r, err)
	}
	if err := w.Close(); err != nil {
		return nil, fmt.Errorf("cache: encoding chunk %v: %w", r, err)
	}
	return out.buf.Bytes(), nil
}

// floatBits writes the little-endian byte planes of v's float32 bits.
func floatBits(v []float32, p0, p1, p2, p3 []uint8) {
	for e, x := range v {
		u := math.Float32bits(x)
		p0[e], p1[e], p2[e], p3[e] = uint8(u), uint8(u>>8), uint8(u>>16), uint8(u>>24)
	}
}

func fromBits(b0, b1, b2, b3 []uint8, out []float32) {
	for e := range out {
		out[e] = math.Float32frombits(uint32(b0[e]) | uint32(b1[e])<<8 | uint32(b2[e])<<16 | uint32(b3[e])<<24)
	}
}

// grow is b resized to n elements, reallocated only when its capacity is
// short (its contents are then not kept).
func grow[T any](b []T, n int) []T {
	if cap(b) < n {
		return make([]T, n)
	}
	return b[:n]
}

// chunk is a decoded chunk file: plain slices over the Arrow buffers plus
// the offsets of each row, ready for per-sample decoding.
type chunk struct {
	name  string
	r     Range
	m     *Manifest
	index []int64
	// per-position columns: tok[tokOff[row]:tokOff[row+1]]
	tokOff []int32
	tok    []int32
	mask   []uint8
	dict   []int32
	code   [3][]uint8 // (positions, K)
	top    []uint16   // compact: (positions)
	delta  [2][]uint8 // compact: (positions, K-1)
	bits   [4][]uint8 // lossless: (positions, K)
	// sampled kinds: drawN (positions); the draws of position p are
	// entries drawOff[p]..drawOff[p+1] of dcode and dcount.
	drawN   []uint16
	drawOff []int32    // (positions+1)
	dcode   [3][]uint8 // (draws)
	dcount  [2][]uint8 // (draws)
	tail    [4][]uint8 // head+sampled: (positions)
}

// decodeChunk parses an Arrow IPC chunk file whose checksum already
// matched, and checks that its structure matches info and m.
func decodeChunk(data []byte, m *Manifest, info ChunkInfo) (*chunk, error) {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: chunk %s (samples %v): %s", ErrCorrupt, info.File, info.Range, fmt.Sprintf(format, a...))
	}
	rd, err := ipc.NewFileReader(bytes.NewReader(data), ipc.WithAllocator(memory.DefaultAllocator))
	if err != nil {
		return nil, bad("not a readable Arrow IPC file: %v", err)
	}
	defer rd.Close()
	want := chunkSchema(m, info.Range)
	if !rd.Schema().Equal(want) {
		return nil, bad("schema %v, want %v", rd.Schema(), want)
	}
	md := rd.Schema().Metadata()
	for i, k := range want.Metadata().Keys() {
		if v, ok := md.GetValue(k); !ok || v != want.Metadata().Values()[i] {
			return nil, bad("metadata %s = %q, want %q", k, v, want.Metadata().Values()[i])
		}
	}
	if rd.NumRecords() != 1 {
		return nil, bad("%d record batches, want 1", rd.NumRecords())
	}
	rec, err := rd.Record(0)
	if err != nil {
		return nil, bad("record batch: %v", err)
	}
	rows := int(rec.NumRows())
	if int64(rows) != info.Len() {
		return nil, bad("%d rows, want %d", rows, info.Len())
	}
	c := &chunk{name: info.File, r: info.Range, m: m}
	c.index = rec.Column(0).(*array.Int64).Int64Values()
	for i, v := range c.index {
		if v != info.Start+int64(i) {
			return nil, bad("row %d holds sample %d, want %d", i, v, info.Start+int64(i))
		}
	}
	lists := map[string]*array.List{}
	for i := 1; i < int(rec.NumCols()); i++ {
		l := rec.Column(i).(*array.List)
		if l.NullN() != 0 {
			return nil, bad("column %s has nulls", rec.ColumnName(i))
		}
		lists[rec.ColumnName(i)] = l
	}
	off := func(name string) []int32 { return lists[name].Offsets()[:rows+1] }
	u8 := func(name string) []uint8 { return lists[name].ListValues().(*array.Uint8).Uint8Values() }
	c.tokOff = off(colInputIDs)
	c.tok = lists[colInputIDs].ListValues().(*array.Int32).Int32Values()
	dOff := off(colIDDict)
	dAll := lists[colIDDict].ListValues().(*array.Int32).Int32Values()
	c.dict = dAll[dOff[0]:dOff[1]]
	if dOff[rows] != dOff[1] {
		return nil, bad("id_dict is not empty after row 0")
	}
	for _, id := range c.dict {
		if id < 0 || int(id) >= m.VocabSize {
			return nil, bad("id_dict holds token id %d outside vocab [0, %d)", id, m.VocabSize)
		}
	}
	K := int32(m.K)
	base := c.tokOff[0]
	// Every per-position column must have the same row boundaries, scaled
	// by its width, so that sample() can index them without more checks.
	check := func(name string, width int32) error {
		o := off(name)
		for r := 0; r <= rows; r++ {
			if o[r]-o[0] != (c.tokOff[r]-base)*width {
				return bad("column %s row %d has %d values, want %d", name, r, o[r]-o[0], (c.tokOff[r]-base)*width)
			}
		}
		return nil
	}
	type col struct {
		name  string
		width int32
		dst   *[]uint8
	}
	cols := []col{{colLossMask, 1, &c.mask}}
	if K > 0 {
		cols = append(cols, col{colIDCode0, K, &c.code[0]}, col{colIDCode1, K, &c.code[1]}, col{colIDCode2, K, &c.code[2]})
		if m.Encoding == EncodingCompact {
			cols = append(cols, col{colLPDelta0, K - 1, &c.delta[0]}, col{colLPDelta1, K - 1, &c.delta[1]})
			if err := check(colLPTop, 1); err != nil {
				return nil, err
			}
			o := off(colLPTop)
			c.top = lists[colLPTop].ListValues().(*array.Uint16).Uint16Values()[o[0]:o[rows]]
		} else {
			for i, n := range []string{colLPBits0, colLPBits1, colLPBits2, colLPBits3} {
				cols = append(cols, col{n, K, &c.bits[i]})
			}
		}
	}
	if m.Kind() == TargetsHeadSampled {
		for i, n := range []string{colTailBits0, colTailBits1, colTailBits2, colTailBits3} {
			cols = append(cols, col{n, 1, &c.tail[i]})
		}
	}
	for _, cl := range cols {
		if err := check(cl.name, cl.width); err != nil {
			return nil, err
		}
		o := off(cl.name)
		*cl.dst = u8(cl.name)[o[0]:o[rows]]
	}
	if m.Sampled() {
		if err := c.decodeDraws(lists, rows, bad); err != nil {
			return nil, err
		}
	}
	c.tok = c.tok[base:c.tokOff[rows]]
	if c.mask == nil {
		c.mask = []uint8{}
	}
	return c, nil
}

// decodeDraws reads the draw columns: draw_n per position, and the draw
// entries, whose row boundaries must be the sums of draw_n.
func (c *chunk) decodeDraws(lists map[string]*array.List, rows int, bad func(string, ...any) error) error {
	base := c.tokOff[0]
	o := lists[colDrawN].Offsets()[:rows+1]
	for r := 0; r <= rows; r++ {
		if o[r]-o[0] != c.tokOff[r]-base {
			return bad("column %s row %d has %d values, want %d", colDrawN, r, o[r]-o[0], c.tokOff[r]-base)
		}
	}
	c.drawN = lists[colDrawN].ListValues().(*array.Uint16).Uint16Values()[o[0]:o[rows]]
	c.drawOff = make([]int32, len(c.drawN)+1)
	for p, n := range c.drawN {
		if int(n) > c.m.Draws {
			return bad("position %d has %d distinct drawn ids, more than the draws %d", p, n, c.m.Draws)
		}
		c.drawOff[p+1] = c.drawOff[p] + int32(n)
	}
	// Row r's draws are positions tokOff[r]-base.. of drawOff.
	names := []string{colDrawCode0, colDrawCode1, colDrawCode2, colDrawCount0, colDrawCount1}
	dsts := []*[]uint8{&c.dcode[0], &c.dcode[1], &c.dcode[2], &c.dcount[0], &c.dcount[1]}
	for i, name := range names {
		lo := lists[name].Offsets()[:rows+1]
		for r := 0; r <= rows; r++ {
			if want := c.drawOff[c.tokOff[r]-base]; lo[r]-lo[0] != want {
				return bad("column %s row %d has %d values, want %d (the sum of draw_n)", name, r, lo[r]-lo[0], want)
			}
		}
		*dsts[i] = lists[name].ListValues().(*array.Uint8).Uint8Values()[lo[0]:lo[rows]]
	}
	return nil
}

// positions returns the position range [p0, p1) of row.
func (c *chunk) positions(row int) (int, int) {
	base := c.tokOff[0]
	return int(c.tokOff[row] - base), int(c.tokOff[row+1] - base)
}

// sample decodes row into s, reusing s's slices when they are big enough.
func (c *chunk) sample(row int, s *Sample) error {
	p0, p1 := c.positions(row)
	T, K := p1-p0, c.m.K
	s.Index = c.index[row]
	s.Tokens = append(s.Tokens[:0], c.tok[p0:p1]...)
	s.Mask = append(s.Mask[:0], c.mask[p0:p1]...)
	n := T * K
	s.TopKIDs, s.TopKLogProbs = grow(s.TopKIDs, n), grow(s.TopKLogProbs, n)
	ids, lps := s.TopKIDs, s.TopKLogProbs
	e0 := p0 * K
	if err := c.ids(c.code, e0, ids, s.Index, K); err != nil {
		return err
	}
	switch {
	case K == 0:
	case c.m.Encoding == EncodingCompact:
		d0, d1 := c.delta[0][p0*(K-1):p1*(K-1)], c.delta[1][p0*(K-1):p1*(K-1)]
		top := c.top[p0:p1]
		for t := 0; t < T; t++ {
			acc := int64(top[t])
			row := lps[t*K : (t+1)*K]
			row[0] = -float32(acc) / lpTopScale
			dd0, dd1 := d0[t*(K-1):(t+1)*(K-1)], d1[t*(K-1):(t+1)*(K-1)]
			for j := 1; j < K; j++ {
				acc += (int64(dd0[j-1]) | int64(dd1[j-1])<<8) * lpDeltaUnit
				row[j] = -float32(acc) / lpTopScale
			}
		}
	default:
		fromBits(c.bits[0][e0:e0+n], c.bits[1][e0:e0+n], c.bits[2][e0:e0+n], c.bits[3][e0:e0+n], lps)
	}
	if !c.m.Sampled() {
		s.DrawN, s.DrawIDs, s.DrawCounts, s.TailMass = nil, nil, nil, nil
		return nil
	}
	s.DrawN = grow(s.DrawN, T)
	for t := range s.DrawN {
		s.DrawN[t] = int32(c.drawN[p0+t])
	}
	a, b := int(c.drawOff[p0]), int(c.drawOff[p1])
	s.DrawIDs, s.DrawCounts = grow(s.DrawIDs, b-a), grow(s.DrawCounts, b-a)
	if err := c.ids(c.dcode, a, s.DrawIDs, s.Index, -1); err != nil {
		return err
	}
	for e := range s.DrawCounts {
		s.DrawCounts[e] = int32(c.dcount[0][a+e]) | int32(c.dcount[1][a+e])<<8
	}
	if c.m.Kind() == TargetsHeadSampled {
		s.TailMass = grow(s.TailMass, T)
		fromBits(c.tail[0][p0:p1], c.tail[1][p0:p1], c.tail[2][p0:p1], c.tail[3][p0:p1], s.TailMass)
	} else {
		s.TailMass = nil
	}
	return nil
}

// ids decodes the dictionary codes planes[.][e0:e0+len(out)] into out;
// width K names positions in errors (-1: draws, whose entries are named).
func (c *chunk) ids(planes [3][]uint8, e0 int, out []int32, index int64, K int) error {
	n := len(out)
	if n == 0 {
		return nil
	}
	a, b, cc := planes[0][e0:e0+n], planes[1][e0:e0+n], planes[2][e0:e0+n]
	nd := uint32(len(c.dict))
	for e := range out {
		code := uint32(a[e]) | uint32(b[e])<<8 | uint32(cc[e])<<16
		if code >= nd {
			if K < 0 {
				return fmt.Errorf("%w: chunk %s sample %d draw entry %d: id code %d >= dictionary size %d", ErrCorrupt, c.name, index, e, code, nd)
			}
			return fmt.Errorf("%w: chunk %s sample %d position %d: id code %d >= dictionary size %d", ErrCorrupt, c.name, index, e/K, code, nd)
		}
		out[e] = c.dict[code]
	}
	return nil
}

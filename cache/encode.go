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
)

// Schema metadata keys of a chunk file (format).
const (
	metaVersion  = "distill.format_version"
	metaEncoding = "distill.encoding"
	metaK        = "distill.k"
	metaVocab    = "distill.vocab_size"
	metaStart    = "distill.range_start"
	metaEnd      = "distill.range_end"
)

func chunkSchema(m *Manifest, r Range) *arrow.Schema {
	u8 := arrow.ListOf(arrow.PrimitiveTypes.Uint8)
	fields := []arrow.Field{
		{Name: colIndex, Type: arrow.PrimitiveTypes.Int64},
		{Name: colInputIDs, Type: arrow.ListOf(arrow.PrimitiveTypes.Int32)},
		{Name: colLossMask, Type: u8},
		{Name: colIDDict, Type: arrow.ListOf(arrow.PrimitiveTypes.Int32)},
		{Name: colIDCode0, Type: u8},
		{Name: colIDCode1, Type: u8},
		{Name: colIDCode2, Type: u8},
	}
	if m.Encoding == EncodingCompact {
		fields = append(fields,
			arrow.Field{Name: colLPTop, Type: arrow.ListOf(arrow.PrimitiveTypes.Uint16)},
			arrow.Field{Name: colLPDelta0, Type: u8},
			arrow.Field{Name: colLPDelta1, Type: u8})
	} else {
		fields = append(fields,
			arrow.Field{Name: colLPBits0, Type: u8},
			arrow.Field{Name: colLPBits1, Type: u8},
			arrow.Field{Name: colLPBits2, Type: u8},
			arrow.Field{Name: colLPBits3, Type: u8})
	}
	md := arrow.NewMetadata(
		[]string{metaVersion, metaEncoding, metaK, metaVocab, metaStart, metaEnd},
		[]string{strconv.Itoa(FormatVersion), string(m.Encoding), strconv.Itoa(m.K),
			strconv.Itoa(m.VocabSize), strconv.FormatInt(r.Start, 10), strconv.FormatInt(r.End, 10)})
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
		if m.Encoding == EncodingCompact && float64(lps[0])*lpTopScale < -math.MaxUint16 {
			return fmt.Errorf("%w: %s: position %d: top-1 log-prob %v below %v; impossible for a distribution over the vocabulary", ErrInvalid, where, t, lps[0], -float64(math.MaxUint16)/lpTopScale)
		}
	}
	return nil
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
	K := m.K
	var positions int64
	for i := range samples {
		positions += int64(len(samples[i].Tokens))
		if err := checkEntries(r, samples[i].Index, positions, K); err != nil {
			return nil, err // ChunkWriter.Add refuses it first; a guard for other callers
		}
	}
	// Chunk dictionary: distinct top-k ids by descending count, so frequent
	// ids get small codes and the high code planes are mostly zero.
	count := make([]int32, m.VocabSize)
	for i := range samples {
		for _, id := range samples[i].TopKIDs {
			count[id]++
		}
	}
	var dict []int32
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
	code := count // reuse: id -> code
	for c, id := range dict {
		code[id] = int32(c)
	}

	mem := memory.DefaultAllocator
	schema := chunkSchema(m, r)
	b := array.NewRecordBuilder(mem, schema)
	defer b.Release()
	list := func(i int) *array.ListBuilder { return b.Field(i).(*array.ListBuilder) }
	u8 := func(i int, v []uint8) {
		lb := list(i)
		lb.Append(true)
		lb.ValueBuilder().(*array.Uint8Builder).AppendValues(v, nil)
	}
	var c0, c1, c2, p0, p1, p2, p3 []uint8
	var top []uint16
	for i := range samples {
		s := &samples[i]
		T := len(s.Tokens)
		b.Field(0).(*array.Int64Builder).Append(s.Index)
		list(1).Append(true)
		list(1).ValueBuilder().(*array.Int32Builder).AppendValues(s.Tokens, nil)
		u8(2, s.Mask)
		list(3).Append(true)
		if i == 0 {
			list(3).ValueBuilder().(*array.Int32Builder).AppendValues(dict, nil)
		}
		n := T * K
		c0, c1, c2 = grow(c0, n), grow(c1, n), grow(c2, n)
		for e, id := range s.TopKIDs {
			c := code[id]
			c0[e], c1[e], c2[e] = uint8(c), uint8(c>>8), uint8(c>>16)
		}
		u8(4, c0)
		u8(5, c1)
		u8(6, c2)
		if m.Encoding == EncodingCompact {
			top = growU16(top, T)
			nd := T * (K - 1)
			p0, p1 = grow(p0, nd), grow(p1, nd)
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
			list(7).Append(true)
			list(7).ValueBuilder().(*array.Uint16Builder).AppendValues(top, nil)
			u8(8, p0)
			u8(9, p1)
		} else {
			p0, p1, p2, p3 = grow(p0, n), grow(p1, n), grow(p2, n), grow(p3, n)
			for e, lp := range s.TopKLogProbs {
				u := math.Float32bits(lp)
				p0[e], p1[e], p2[e], p3[e] = uint8(u), uint8(u>>8), uint8(u>>16), uint8(u>>24)
			}
			u8(7, p0)
			u8(8, p1)
			u8(9, p2)
			u8(10, p3)
		}
	}
	rec := b.NewRecord()
	defer rec.Release()
	var out countWriter
	w, err := ipc.NewFileWriter(&out, ipc.WithSchema(schema), ipc.WithAllocator(mem),
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

func grow(b []uint8, n int) []uint8 {
	if cap(b) < n {
		return make([]uint8, n)
	}
	return b[:n]
}

func growU16(b []uint16, n int) []uint16 {
	if cap(b) < n {
		return make([]uint16, n)
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
}

type listCol struct {
	off  []int32
	data arrow.Array
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
	lists := make([]*array.List, rec.NumCols())
	for i := 1; i < int(rec.NumCols()); i++ {
		l := rec.Column(i).(*array.List)
		if l.NullN() != 0 {
			return nil, bad("column %s has nulls", rec.ColumnName(i))
		}
		lists[i] = l
	}
	off := func(i int) []int32 { return lists[i].Offsets()[:rows+1] }
	u8 := func(i int) []uint8 { return lists[i].ListValues().(*array.Uint8).Uint8Values() }
	c.tokOff = off(1)
	c.tok = lists[1].ListValues().(*array.Int32).Int32Values()
	c.mask = u8(2)
	dOff := off(3)
	dAll := lists[3].ListValues().(*array.Int32).Int32Values()
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
	check := func(col int, width int32) error {
		o := off(col)
		for r := 0; r <= rows; r++ {
			if o[r]-o[0] != (c.tokOff[r]-base)*width {
				return bad("column %s row %d has %d values, want %d", rec.ColumnName(col), r, o[r]-o[0], (c.tokOff[r]-base)*width)
			}
		}
		return nil
	}
	cols := []struct {
		col   int
		width int32
		dst   *[]uint8
	}{{2, 1, &c.mask}, {4, K, &c.code[0]}, {5, K, &c.code[1]}, {6, K, &c.code[2]}}
	if m.Encoding == EncodingCompact {
		cols = append(cols, struct {
			col   int
			width int32
			dst   *[]uint8
		}{8, K - 1, &c.delta[0]}, struct {
			col   int
			width int32
			dst   *[]uint8
		}{9, K - 1, &c.delta[1]})
		if err := check(7, 1); err != nil {
			return nil, err
		}
		o := off(7)
		c.top = lists[7].ListValues().(*array.Uint16).Uint16Values()[o[0]:o[rows]]
	} else {
		for i := 0; i < 4; i++ {
			cols = append(cols, struct {
				col   int
				width int32
				dst   *[]uint8
			}{7 + i, K, &c.bits[i]})
		}
	}
	for _, cl := range cols {
		if err := check(cl.col, cl.width); err != nil {
			return nil, err
		}
		o := off(cl.col)
		*cl.dst = u8(cl.col)[o[0]:o[rows]]
	}
	c.tok = c.tok[base:c.tokOff[rows]]
	if c.mask == nil {
		c.mask = []uint8{}
	}
	return c, nil
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
	if cap(s.TopKIDs) < n {
		s.TopKIDs = make([]int32, n)
	}
	if cap(s.TopKLogProbs) < n {
		s.TopKLogProbs = make([]float32, n)
	}
	ids, lps := s.TopKIDs[:n], s.TopKLogProbs[:n]
	s.TopKIDs, s.TopKLogProbs = ids, lps
	e0 := p0 * K
	a, b, cc := c.code[0][e0:e0+n], c.code[1][e0:e0+n], c.code[2][e0:e0+n]
	nd := uint32(len(c.dict))
	for e := range ids {
		code := uint32(a[e]) | uint32(b[e])<<8 | uint32(cc[e])<<16
		if code >= nd {
			return fmt.Errorf("%w: chunk %s sample %d position %d: id code %d >= dictionary size %d", ErrCorrupt, c.name, s.Index, e/K, code, nd)
		}
		ids[e] = c.dict[code]
	}
	if c.m.Encoding == EncodingCompact {
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
	} else {
		b0, b1, b2, b3 := c.bits[0][e0:e0+n], c.bits[1][e0:e0+n], c.bits[2][e0:e0+n], c.bits[3][e0:e0+n]
		for e := range lps {
			lps[e] = math.Float32frombits(uint32(b0[e]) | uint32(b1[e])<<8 | uint32(b2[e])<<16 | uint32(b3[e])<<24)
		}
	}
	return nil
}

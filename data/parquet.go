package data

import (
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"math"
	"os"
	"sort"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/apache/arrow/go/v17/arrow"
	"github.com/apache/arrow/go/v17/arrow/array"
	"github.com/apache/arrow/go/v17/arrow/memory"
	"github.com/apache/arrow/go/v17/parquet/file"
	"github.com/apache/arrow/go/v17/parquet/pqarrow"

	"distill/data/chattmpl"
	"distill/internal/errkind"
)

// parquetReader reads rows of a Parquet file (the format of HF datasets).
// Only the top-level columns a record shape can use are decoded. Rows are
// read a row group at a time and the last few row groups are kept, so a
// sequential fill decodes each row group once; random access across many
// row groups (Shuffle over a large file) decodes a row group per miss.
type parquetReader struct {
	path    string
	f       *os.File
	fr      *pqarrow.FileReader
	leaves  []int    // parquet leaf columns to read
	names   []string // top-level column names, in the order of the read table
	rgStart []int64  // rgStart[g] = first row of row group g; rgStart[len] = rows
	hash    [32]byte

	mu    sync.Mutex
	cache []*rowGroup // most recently used last
}

// rowGroupCache is how many decoded row groups a parquetReader keeps.
const rowGroupCache = 2

type rowGroup struct {
	idx    int
	chunks [][]arrow.Array // [column][chunk]
	ends   [][]int64       // [column][chunk] cumulative row count
}

func openParquet(path string, cols ColumnMap) (*parquetReader, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, errkind.Errorf(ErrSource, "%v", err)
	}
	r := &parquetReader{path: path, f: f}
	if err := r.open(cols); err != nil {
		f.Close()
		return nil, err
	}
	return r, nil
}

func (r *parquetReader) open(cols ColumnMap) error {
	h := sha256.New()
	if _, err := io.Copy(h, r.f); err != nil {
		return errkind.Errorf(ErrSource, "%s: read: %v", r.path, err)
	}
	copy(r.hash[:], h.Sum(nil))
	pf, err := file.NewParquetReader(r.f)
	if err != nil {
		return errkind.Errorf(ErrSource, "%s: not a readable Parquet file: %v", r.path, err)
	}
	r.fr, err = pqarrow.NewFileReader(pf, pqarrow.ArrowReadProperties{BatchSize: 1 << 14}, memory.DefaultAllocator)
	if err != nil {
		return errkind.Errorf(ErrSource, "%s: Parquet schema: %v", r.path, err)
	}
	want := map[string]bool{"tools": true}
	for _, n := range []string{cols.Messages, cols.Prompt, cols.Response, cols.System, cols.Text, cols.InputIDs, cols.LossMask} {
		want[n] = true
	}
	var all []string
	for i := range r.fr.Manifest.Fields {
		sf := &r.fr.Manifest.Fields[i]
		all = append(all, sf.Field.Name)
		if !want[sf.Field.Name] {
			continue
		}
		r.names = append(r.names, sf.Field.Name)
		collectLeaves(sf, &r.leaves)
	}
	if len(r.names) == 0 {
		return errkind.Errorf(ErrSource, "%s: no usable column (have %s; want messages, prompt/response, text or input_ids, or set the column mapping)",
			r.path, strings.Join(all, ", "))
	}
	sort.Ints(r.leaves)
	// ReadRowGroups returns top-level fields in schema order, which is the
	// order names was built in.
	r.rgStart = make([]int64, pf.NumRowGroups()+1)
	for g := 0; g < pf.NumRowGroups(); g++ {
		r.rgStart[g+1] = r.rgStart[g] + pf.RowGroup(g).NumRows()
	}
	if r.rgStart[len(r.rgStart)-1] == 0 {
		return errkind.Errorf(ErrSource, "%s: no rows", r.path)
	}
	return nil
}

// collectLeaves appends the parquet leaf columns under sf. (Nested fields
// carry ColIndex 0, not -1, so IsLeaf cannot be trusted; childlessness can.)
func collectLeaves(sf *pqarrow.SchemaField, out *[]int) {
	if len(sf.Children) == 0 {
		*out = append(*out, sf.ColIndex)
		return
	}
	for i := range sf.Children {
		collectLeaves(&sf.Children[i], out)
	}
}

func (r *parquetReader) numRecords() int64     { return r.rgStart[len(r.rgStart)-1] }
func (r *parquetReader) contentHash() [32]byte { return r.hash }
func (r *parquetReader) close() error          { return r.f.Close() }

func (r *parquetReader) rowGroup(g int) (*rowGroup, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, c := range r.cache {
		if c.idx == g {
			r.cache = append(append(r.cache[:i:i], r.cache[i+1:]...), c)
			return c, nil
		}
	}
	tbl, err := r.fr.ReadRowGroups(context.Background(), r.leaves, []int{g})
	if err != nil {
		return nil, errkind.Errorf(ErrSource, "%s: row group %d: %v", r.path, g, err)
	}
	rg := &rowGroup{idx: g}
	if int(tbl.NumCols()) != len(r.names) {
		return nil, errkind.Errorf(ErrSource, "%s: row group %d: read %d columns, want %d", r.path, g, tbl.NumCols(), len(r.names))
	}
	for c := 0; c < int(tbl.NumCols()); c++ {
		if got := tbl.Schema().Field(c).Name; got != r.names[c] {
			return nil, errkind.Errorf(ErrSource, "%s: row group %d: column %d is %q, want %q", r.path, g, c, got, r.names[c])
		}
		ch := tbl.Column(c).Data().Chunks()
		ends := make([]int64, len(ch))
		var n int64
		for k, a := range ch {
			n += int64(a.Len())
			ends[k] = n
		}
		rg.chunks = append(rg.chunks, ch)
		rg.ends = append(rg.ends, ends)
	}
	if len(r.cache) == rowGroupCache {
		r.cache = r.cache[1:]
	}
	r.cache = append(r.cache, rg)
	return rg, nil
}

func (r *parquetReader) read(rec int64) (map[string]any, string, error) {
	loc := fmt.Sprintf("%s:row %d", r.path, rec)
	g := sort.Search(len(r.rgStart)-1, func(i int) bool { return r.rgStart[i+1] > rec })
	rg, err := r.rowGroup(g)
	if err != nil {
		return nil, loc, err
	}
	row := rec - r.rgStart[g]
	obj := make(map[string]any, len(r.names))
	for c, name := range r.names {
		k := sort.Search(len(rg.ends[c]), func(i int) bool { return rg.ends[c][i] > row })
		start := int64(0)
		if k > 0 {
			start = rg.ends[c][k-1]
		}
		v, err := arrowValue(rg.chunks[c][k], int(row-start))
		if err != nil {
			return nil, loc, withLoc(prefixField(err, name), loc)
		}
		if v != nil {
			obj[name] = v
		}
	}
	return obj, loc, nil
}

// arrowValue converts element i of an Arrow array to the value a JSON decoder
// would give (string, int64, float64, bool, []any, map[string]any, nil),
// refusing strings that are not UTF-8.
func arrowValue(a arrow.Array, i int) (any, error) {
	if a.IsNull(i) {
		return nil, nil
	}
	switch t := a.(type) {
	case *array.String:
		return checkedString(t.Value(i))
	case *array.LargeString:
		return checkedString(t.Value(i))
	case *array.StringView:
		return checkedString(t.Value(i))
	case *array.Binary:
		return checkedString(string(t.Value(i)))
	case *array.LargeBinary:
		return checkedString(string(t.Value(i)))
	case *array.Boolean:
		return t.Value(i), nil
	case *array.Int8:
		return int64(t.Value(i)), nil
	case *array.Int16:
		return int64(t.Value(i)), nil
	case *array.Int32:
		return int64(t.Value(i)), nil
	case *array.Int64:
		return t.Value(i), nil
	case *array.Uint8:
		return int64(t.Value(i)), nil
	case *array.Uint16:
		return int64(t.Value(i)), nil
	case *array.Uint32:
		return int64(t.Value(i)), nil
	case *array.Uint64:
		if t.Value(i) > math.MaxInt64 {
			return nil, badf("", "out of range", "value %d does not fit int64", t.Value(i))
		}
		return int64(t.Value(i)), nil
	case *array.Float32:
		return float64(t.Value(i)), nil
	case *array.Float64:
		return t.Value(i), nil
	case *array.Dictionary:
		return arrowValue(t.Dictionary(), t.GetValueIndex(i))
	case array.ListLike:
		start, end := t.ValueOffsets(i)
		vals := t.ListValues()
		out := make([]any, 0, end-start)
		for j := start; j < end; j++ {
			v, err := arrowValue(vals, int(j))
			if err != nil {
				return nil, prefixField(err, fmt.Sprintf("[%d]", j-start))
			}
			out = append(out, v)
		}
		return out, nil
	case *array.Struct:
		// An ordered dict, as HF datasets gives Python: the template's
		// tojson prints the fields in schema order (asMap reads it).
		st := t.DataType().(*arrow.StructType)
		out := chattmpl.NewDict()
		for f := 0; f < st.NumFields(); f++ {
			v, err := arrowValue(t.Field(f), i)
			if err != nil {
				return nil, prefixField(err, st.Field(f).Name)
			}
			out.Set(st.Field(f).Name, v)
		}
		return out, nil
	}
	return nil, badf("", "unsupported column type", "Arrow type %s cannot be read; use strings, integers, lists or structs", a.DataType())
}

func checkedString(s string) (any, error) {
	if !utf8.ValidString(s) {
		return nil, badf("", "invalid UTF-8", "the string is not valid UTF-8; re-encode the dataset as UTF-8")
	}
	return s, nil
}

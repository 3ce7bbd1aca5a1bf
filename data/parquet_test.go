package data

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/apache/arrow/go/v17/arrow"
	"github.com/apache/arrow/go/v17/arrow/array"
	"github.com/apache/arrow/go/v17/arrow/memory"
	"github.com/apache/arrow/go/v17/parquet"
	"github.com/apache/arrow/go/v17/parquet/pqarrow"

	"distill/data/chattmpl"
)

// writeParquet writes rows in the HF datasets layout: messages as
// list<struct<role, content>>, text as string, input_ids as list<int64>, plus
// an unused column, with rowsPerGroup rows per row group.
func writeParquet(t *testing.T, path string, msgs [][][2]string, texts []*string, ids [][]int64, rowsPerGroup int64) {
	t.Helper()
	msgType := arrow.StructOf(arrow.Field{Name: "role", Type: arrow.BinaryTypes.String}, arrow.Field{Name: "content", Type: arrow.BinaryTypes.String})
	schema := arrow.NewSchema([]arrow.Field{
		{Name: "id", Type: arrow.PrimitiveTypes.Int64},
		{Name: "messages", Type: arrow.ListOf(msgType), Nullable: true},
		{Name: "text", Type: arrow.BinaryTypes.String, Nullable: true},
		{Name: "input_ids", Type: arrow.ListOf(arrow.PrimitiveTypes.Int64), Nullable: true},
	}, nil)
	b := array.NewRecordBuilder(memory.DefaultAllocator, schema)
	defer b.Release()
	for i := range texts {
		b.Field(0).(*array.Int64Builder).Append(int64(i))
		lb := b.Field(1).(*array.ListBuilder)
		if msgs[i] == nil {
			lb.AppendNull()
		} else {
			lb.Append(true)
			sb := lb.ValueBuilder().(*array.StructBuilder)
			for _, m := range msgs[i] {
				sb.Append(true)
				sb.FieldBuilder(0).(*array.StringBuilder).Append(m[0])
				sb.FieldBuilder(1).(*array.StringBuilder).Append(m[1])
			}
		}
		if texts[i] == nil {
			b.Field(2).(*array.StringBuilder).AppendNull()
		} else {
			b.Field(2).(*array.StringBuilder).Append(*texts[i])
		}
		ib := b.Field(3).(*array.ListBuilder)
		if ids[i] == nil {
			ib.AppendNull()
		} else {
			ib.Append(true)
			for _, x := range ids[i] {
				ib.ValueBuilder().(*array.Int64Builder).Append(x)
			}
		}
	}
	rec := b.NewRecord()
	defer rec.Release()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	w, err := pqarrow.NewFileWriter(schema, f, parquet.NewWriterProperties(parquet.WithMaxRowGroupLength(rowsPerGroup)), pqarrow.DefaultWriterProps())
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Write(rec); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
}

func sp(s string) *string { return &s }

func TestParquet(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "train.parquet")
	msgs := [][][2]string{
		{{"user", "hi"}, {"assistant", "yo"}}, nil, nil,
		{{"user", "q"}, {"assistant", "a1"}, {"user", "q2"}, {"assistant", "a2"}}, nil, nil, nil,
	}
	texts := []*string{nil, sp("plain"), nil, nil, sp("bad \xff utf8"), sp("t5"), nil}
	ids := [][]int64{nil, nil, {5, 6, 7}, nil, nil, nil, {1, 9999}}
	writeParquet(t, p, msgs, texts, ids, 3) // row groups of 3, 3, 1 rows
	tok := newFakeTok()
	d := openFake(t, tok, chatML{}, Options{NoEOS: true, SkipBad: true, Workers: 3}, Source{Path: p})
	if d.Len() != 7 {
		t.Fatalf("Len = %d, want 7", d.Len())
	}
	s := all(t, d)
	if got := targets(tok, s[0]); !slices.Equal(got, []string{"yo<|im_end|>"}) {
		t.Errorf("row 0 targets %q", got)
	}
	if got := tok.decode(s[1].IDs); got != "plain" {
		t.Errorf("row 1 = %q", got)
	}
	if len(s[2].IDs) != 3 || s[2].IDs[0] != 5 || s[2].IDs[2] != 7 {
		t.Errorf("row 2 ids %v", s[2].IDs)
	}
	if got := targets(tok, s[3]); !slices.Equal(got, []string{"a1<|im_end|>", "a2<|im_end|>"}) {
		t.Errorf("row 3 targets %q", got)
	}
	if s[4].Status != Skipped || !strings.Contains(s[4].Reason, "train.parquet:row 4: text: invalid UTF-8") {
		t.Errorf("row 4: %+v", s[4])
	}
	if tok.decode(s[5].IDs) != "t5" {
		t.Errorf("row 5 = %q", tok.decode(s[5].IDs))
	}
	if s[6].Status != Skipped || !strings.Contains(s[6].Reason, "row 6: input_ids[1]: id out of vocab") {
		t.Errorf("row 6: %+v", s[6])
	}
	// Ranges that start inside a row group read the same rows.
	r, err := d.Range(context.Background(), 4, 6)
	if err != nil || r[1].Index != 5 || tok.decode(r[1].IDs) != "t5" {
		t.Errorf("range [4,6): %+v %v", r, err)
	}
	d2 := openFake(t, tok, chatML{}, Options{}, Source{Path: p})
	if _, err := d2.Range(context.Background(), 0, 7); !errors.Is(err, ErrBadRecord) || !strings.Contains(err.Error(), "row 4") {
		t.Errorf("without SkipBad: %v", err)
	}
}

func TestParquetWithoutUsableColumns(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "x.parquet")
	writeParquet(t, p, [][][2]string{nil}, []*string{sp("x")}, [][]int64{nil}, 10)
	_, err := open([]Source{{Path: p, Columns: ColumnMap{Messages: "m", Text: "body", InputIDs: "ids"}}}, newFakeTok(), nil, Options{})
	if !errors.Is(err, ErrSource) || !strings.Contains(err.Error(), "no usable column (have id, messages, text, input_ids") {
		t.Errorf("got %v", err)
	}
}

// TestParquetStructKeepsFieldOrder: a Parquet struct (tool call arguments,
// say) reaches the template with its fields in schema order, as HF datasets
// gives Python dicts, so tojson prints them in that order (package doc).
func TestParquetStructKeepsFieldOrder(t *testing.T) {
	st := arrow.StructOf(arrow.Field{Name: "zeta", Type: arrow.PrimitiveTypes.Int64}, arrow.Field{Name: "alpha", Type: arrow.BinaryTypes.String})
	b := array.NewStructBuilder(memory.DefaultAllocator, st)
	defer b.Release()
	b.Append(true)
	b.FieldBuilder(0).(*array.Int64Builder).Append(1)
	b.FieldBuilder(1).(*array.StringBuilder).Append("a")
	a := b.NewArray()
	defer a.Release()
	v, err := arrowValue(a, 0)
	if err != nil {
		t.Fatal(err)
	}
	tmpl, err := chattmpl.Compile("{{ messages[0].tool_calls[0] | tojson }}")
	if err != nil {
		t.Fatal(err)
	}
	out, err := tmpl.Render([]chattmpl.Message{{Role: "assistant", ToolCalls: []any{v}}}, chattmpl.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"zeta": 1, "alpha": "a"}`; out != want {
		t.Fatalf("tojson of a Parquet struct: %s, want %s (schema field order)", out, want)
	}
}

package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	iofs "io/fs"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/apache/arrow/go/v17/arrow"
	"github.com/apache/arrow/go/v17/arrow/array"
	"github.com/apache/arrow/go/v17/arrow/memory"
	"github.com/apache/arrow/go/v17/parquet"
	"github.com/apache/arrow/go/v17/parquet/compress"
	"github.com/apache/arrow/go/v17/parquet/pqarrow"

	"distill/cache"
	"distill/internal/atomicfile"
	"distill/internal/cli"
)

func init() {
	commands.Register(&cli.Command{Name: "export", Summary: "export a cache as JSONL or Parquet, one decoded record per sample", Run: func(args []string) error {
		ctx, stop := signalContext()
		defer stop()
		return exportCtx(ctx, args, os.Stdout, os.Stderr)
	}})
}

// exportBatch is how many samples go into one Parquet row group batch.
const exportBatch = 64

func exportMain(args []string, stdout, stderr io.Writer) error {
	return exportCtx(context.Background(), args, stdout, stderr)
}

// exportCtx is export stopped by ctx: a signal (Ctrl-C) that cancels ctx
// stops the writing, and an --out file is then not written at all. Ctrl-C
// killed the process and left the half-written temporary file
// (--out.<random>.tmp, hundreds of MB) next to --out.
func exportCtx(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("cachectl export", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var dirs cacheDirs
	fs.Var(&dirs, "cache", "cache directory (repeatable)")
	format := fs.String("format", "", "jsonl or parquet (default: parquet for an --out ending in .parquet, else jsonl)")
	out := fs.String("out", "", "output file, outside the cache directories (default: stdout)")
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	if err := noArgs(fs); err != nil {
		return err
	}
	// The format follows --out's extension unless given; given, it must
	// not contradict it (an x.parquet that holds JSONL opens nowhere).
	ext := strings.ToLower(filepath.Ext(*out))
	switch {
	case *format == "" && ext == ".parquet":
		*format = "parquet"
	case *format == "":
		*format = "jsonl"
	case *format != "jsonl" && *format != "parquet":
		return cli.Usagef("--format %q: want jsonl or parquet", *format)
	case *format == "jsonl" && ext == ".parquet", *format == "parquet" && (ext == ".jsonl" || ext == ".json"):
		return cli.Usagef("--format %s with --out %s: the file's extension says the other format; give --out a name that ends in .%s, or leave out --format", *format, *out, *format)
	}
	if *out != "" {
		if err := checkOutOutsideCaches(*out, dirs, *format); err != nil {
			return err
		}
	}
	r, err := openCacheReader(dirs)
	if err != nil {
		return err
	}
	m := r.Manifest()
	// export writes the whole cache to w. Its error is the cache's (a
	// damaged chunk: cacheErr) or w's (a full disk: outErr).
	var cacheErr, outErr error
	export := func(w io.Writer) error {
		ow := &outWriter{w: w, ctx: ctx}
		it, err := r.Iter(cache.IterOptions{Sequential: true, ReadAhead: 2})
		if err == nil {
			if *format == "jsonl" {
				err = exportJSONL(it, m, ow)
			} else {
				err = exportParquet(it, m, ow)
			}
			it.Close()
		}
		if ow.err != nil {
			// The output's error, not what it made the writer say
			// ("parquet writer: failed to write magic number").
			outErr, err = ow.err, ow.err
		} else {
			cacheErr = err
		}
		return err
	}
	// stopped is the error of an export a signal stopped.
	stopped := func(what string) error {
		var se signalError
		if !errors.As(context.Cause(ctx), &se) {
			return nil
		}
		ss, _ := se.sig.(syscall.Signal)
		return &cli.Interrupted{Signal: ss, Msg: fmt.Sprintf("stopped by %s: %s", cli.SignalName(se.sig), what)}
	}
	if *out == "" {
		err := export(stdout)
		if err != nil {
			if in := stopped("the output is incomplete; run the export again"); in != nil {
				return in
			}
		}
		return err
	}
	fi, err := os.Stat(*out)
	switch {
	case err == nil && fi.IsDir():
		return fmt.Errorf("--out %s is a directory: give a file name, e.g. %s", *out, filepath.Join(*out, "cache."+*format))
	case err == nil && !fi.Mode().IsRegular():
		// A device or a pipe (/dev/null, a FIFO) is written as it is:
		// a rename would replace it.
		f, err := os.OpenFile(*out, os.O_WRONLY, 0)
		if err != nil {
			return fmt.Errorf("--out: %w", err)
		}
		if err := export(f); err != nil {
			f.Close()
			if in := stopped("the output is incomplete; run the export again"); in != nil {
				return in
			}
			return err
		}
		return f.Close()
	}
	// A regular file is written whole or not at all: an export that
	// failed halfway (a damaged chunk, a full disk) left an empty JSONL
	// file or a 4-byte Parquet file that no reader opens.
	if err := atomicfile.Write(*out, 0o644, export); err != nil {
		if in := stopped(fmt.Sprintf("nothing written to %s (an export to --out is written whole or not at all); run the export again", *out)); in != nil {
			return in
		}
		var pe *iofs.PathError
		switch {
		case cacheErr != nil:
			return cacheErr
		case errors.As(outErr, &pe):
			// pe names the temporary file, which is gone.
			return fmt.Errorf("--out: writing %s: %w", *out, pe.Err)
		}
		return fmt.Errorf("--out: %w", err)
	}
	return nil
}

// checkOutOutsideCaches refuses, before any cache is opened, an --out
// that is one of the cache directories read or lies inside one (its
// index/ or chunks/): the export's file was renamed into the cache's own
// files, and an --out of index/MANIFEST broke the index. Symbolic links
// are followed as the write would follow them.
func checkOutOutsideCaches(out string, dirs []string, format string) error {
	o, err := resolvedPath(out)
	if err != nil {
		return nil // the write names what is wrong with --out
	}
	for _, d := range dirs {
		abs, err := filepath.Abs(d)
		if err != nil {
			continue
		}
		real, err := filepath.EvalSymlinks(abs)
		if err != nil {
			continue // opening the cache names it
		}
		rel, err := filepath.Rel(real, o)
		if err != nil || !filepath.IsLocal(rel) {
			continue
		}
		alt := filepath.Clean(d)
		if alt == "." || alt == ".." || alt == string(filepath.Separator) {
			alt = abs
		}
		return cli.Usagef("--out %s is inside --cache %s, the cache directory being exported: the export would be written among the cache's own files and damage it; nothing was written: give a path outside it, e.g. --out %s.%s",
			out, d, alt, format)
	}
	return nil
}

// resolvedPath is path made absolute with the symbolic links of its
// longest existing part resolved (the file need not exist yet).
func resolvedPath(path string) (string, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", err
	}
	rest := ""
	for p := abs; ; p = filepath.Dir(p) {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			return filepath.Join(real, rest), nil
		}
		if filepath.Dir(p) == p {
			return abs, nil
		}
		rest = filepath.Join(filepath.Base(p), rest)
	}
}

// outWriter keeps the first error of writing the export's output, so
// that it is told from the cache's errors.
type outWriter struct {
	w   io.Writer
	ctx context.Context // its cancellation (a signal) fails the next write
	err error
}

func (o *outWriter) Write(p []byte) (int, error) {
	if err := context.Cause(o.ctx); err != nil {
		if o.err == nil {
			o.err = err
		}
		return 0, err
	}
	n, err := o.w.Write(p)
	if err != nil && o.err == nil {
		o.err = err
	}
	return n, err
}

// exportJSONL writes {"index", "input_ids", "loss_mask", "topk_ids",
// "topk_logprobs"} per line; log-probs are the shortest decimal that reads
// back as the same float32; a non-finite log-prob (possible only in the
// lossless encoding) is written as null. A cache of a sampled kind adds
// "draws" (N), "draw_ids" and "draw_counts" ([positions][distinct ids],
// most drawn first: the target of id v is count_v/N) and, head+sampled,
// "tail_mass" ([positions]: the target is then tail_mass·count_v/N); its
// topk_* hold the head (empty lists for sampled, k 0).
func exportJSONL(it *cache.Iterator, m cache.Manifest, w io.Writer) error {
	K, kind := m.K, m.Kind()
	bw := bufio.NewWriterSize(w, 1<<20)
	var b []byte
	ints := func(b []byte, v []int32) []byte {
		b = append(b, '[')
		for i, x := range v {
			if i > 0 {
				b = append(b, ',')
			}
			b = strconv.AppendInt(b, int64(x), 10)
		}
		return append(b, ']')
	}
	for it.Next() {
		s := it.Sample()
		b = append(b[:0], `{"index":`...)
		b = strconv.AppendInt(b, s.Index, 10)
		b = append(b, `,"input_ids":[`...)
		for i, v := range s.Tokens {
			if i > 0 {
				b = append(b, ',')
			}
			b = strconv.AppendInt(b, int64(v), 10)
		}
		b = append(b, `],"loss_mask":[`...)
		for i, v := range s.Mask {
			if i > 0 {
				b = append(b, ',')
			}
			b = strconv.AppendInt(b, int64(v), 10)
		}
		b = append(b, `],"topk_ids":[`...)
		T := len(s.Tokens)
		for t := 0; t < T; t++ {
			if t > 0 {
				b = append(b, ',')
			}
			b = append(b, '[')
			for j := 0; j < K; j++ {
				if j > 0 {
					b = append(b, ',')
				}
				b = strconv.AppendInt(b, int64(s.TopKIDs[t*K+j]), 10)
			}
			b = append(b, ']')
		}
		b = append(b, `],"topk_logprobs":[`...)
		for t := 0; t < T; t++ {
			if t > 0 {
				b = append(b, ',')
			}
			b = append(b, '[')
			for j := 0; j < K; j++ {
				if j > 0 {
					b = append(b, ',')
				}
				v := s.TopKLogProbs[t*K+j]
				if math.IsInf(float64(v), 0) || math.IsNaN(float64(v)) {
					b = append(b, "null"...)
				} else {
					b = strconv.AppendFloat(b, float64(v), 'g', -1, 32)
				}
			}
			b = append(b, ']')
		}
		b = append(b, ']')
		if kind != cache.TargetsTopK {
			b = append(b, `,"draws":`...)
			b = strconv.AppendInt(b, int64(m.Draws), 10)
			for _, f := range []struct {
				key string
				v   []int32
			}{{"draw_ids", s.DrawIDs}, {"draw_counts", s.DrawCounts}} {
				b = append(b, `,"`+f.key+`":[`...)
				off := 0
				for t := 0; t < T; t++ {
					if t > 0 {
						b = append(b, ',')
					}
					n := int(s.DrawN[t])
					b = ints(b, f.v[off:off+n])
					off += n
				}
				b = append(b, ']')
			}
			if kind == cache.TargetsHeadSampled {
				b = append(b, `,"tail_mass":[`...)
				for t, v := range s.TailMass {
					if t > 0 {
						b = append(b, ',')
					}
					b = strconv.AppendFloat(b, float64(v), 'g', -1, 32)
				}
				b = append(b, ']')
			}
		}
		b = append(b, "}\n"...)
		if _, err := bw.Write(b); err != nil {
			return err
		}
	}
	if err := it.Err(); err != nil {
		return err
	}
	return bw.Flush()
}

// exportSchema is the Parquet export schema of a cache of kind: topk_*
// are [positions][k]; the sampled kinds add draw_ids and draw_counts
// ([positions][distinct ids], as the JSONL export) and, head+sampled,
// tail_mass ([positions]), with the draws N in the schema's metadata
// (distill.targets, distill.draws).
func exportSchema(m cache.Manifest) *arrow.Schema {
	fields := []arrow.Field{
		{Name: "index", Type: arrow.PrimitiveTypes.Int64},
		{Name: "input_ids", Type: arrow.ListOf(arrow.PrimitiveTypes.Int32)},
		{Name: "loss_mask", Type: arrow.ListOf(arrow.PrimitiveTypes.Uint8)},
		{Name: "topk_ids", Type: arrow.ListOf(arrow.ListOf(arrow.PrimitiveTypes.Int32))},
		{Name: "topk_logprobs", Type: arrow.ListOf(arrow.ListOf(arrow.PrimitiveTypes.Float32))},
	}
	if m.Kind() == cache.TargetsTopK {
		return arrow.NewSchema(fields, nil)
	}
	fields = append(fields,
		arrow.Field{Name: "draw_ids", Type: arrow.ListOf(arrow.ListOf(arrow.PrimitiveTypes.Int32))},
		arrow.Field{Name: "draw_counts", Type: arrow.ListOf(arrow.ListOf(arrow.PrimitiveTypes.Int32))})
	if m.Kind() == cache.TargetsHeadSampled {
		fields = append(fields, arrow.Field{Name: "tail_mass", Type: arrow.ListOf(arrow.PrimitiveTypes.Float32)})
	}
	md := arrow.NewMetadata([]string{"distill.targets", "distill.draws"}, []string{string(m.Kind()), strconv.Itoa(m.Draws)})
	return arrow.NewSchema(fields, &md)
}

// newParquetWriter is pqarrow.NewFileWriter, which panics ("failed to
// write magic number") when its first write fails (a full disk): the
// export died with a stack trace and exit status 2. The write's own error
// is kept by the outWriter under w and reported from there.
func newParquetWriter(schema *arrow.Schema, w io.Writer, props *parquet.WriterProperties) (pw *pqarrow.FileWriter, err error) {
	defer func() {
		if r := recover(); r != nil {
			pw, err = nil, fmt.Errorf("parquet writer: %v", r)
		}
	}()
	pw, err = pqarrow.NewFileWriter(schema, w, props, pqarrow.DefaultWriterProps())
	if err != nil {
		return nil, fmt.Errorf("parquet writer: %w", err)
	}
	return pw, nil
}

func exportParquet(it *cache.Iterator, m cache.Manifest, w io.Writer) error {
	K, kind := m.K, m.Kind()
	schema := exportSchema(m)
	props := parquet.NewWriterProperties(parquet.WithCompression(compress.Codecs.Zstd))
	// The struct hides w's Close: pqarrow closes a writer that has one, and
	// w may be stdout or a file the caller closes and checks.
	pw, err := newParquetWriter(schema, struct{ io.Writer }{w}, props)
	if err != nil {
		return err
	}
	b := array.NewRecordBuilder(memory.DefaultAllocator, schema)
	defer b.Release()
	rows := 0
	flush := func() error {
		if rows == 0 {
			return nil
		}
		rec := b.NewRecord()
		defer rec.Release()
		rows = 0
		return pw.Write(rec)
	}
	for it.Next() {
		s := it.Sample()
		T := len(s.Tokens)
		b.Field(0).(*array.Int64Builder).Append(s.Index)
		lb := b.Field(1).(*array.ListBuilder)
		lb.Append(true)
		lb.ValueBuilder().(*array.Int32Builder).AppendValues(s.Tokens, nil)
		mb := b.Field(2).(*array.ListBuilder)
		mb.Append(true)
		mb.ValueBuilder().(*array.Uint8Builder).AppendValues(s.Mask, nil)
		ib := b.Field(3).(*array.ListBuilder)
		ib.Append(true)
		iib := ib.ValueBuilder().(*array.ListBuilder)
		pb := b.Field(4).(*array.ListBuilder)
		pb.Append(true)
		ppb := pb.ValueBuilder().(*array.ListBuilder)
		for t := 0; t < T; t++ {
			iib.Append(true)
			iib.ValueBuilder().(*array.Int32Builder).AppendValues(s.TopKIDs[t*K:(t+1)*K], nil)
			ppb.Append(true)
			ppb.ValueBuilder().(*array.Float32Builder).AppendValues(s.TopKLogProbs[t*K:(t+1)*K], nil)
		}
		if kind != cache.TargetsTopK {
			for f, v := range [][]int32{s.DrawIDs, s.DrawCounts} {
				db := b.Field(5 + f).(*array.ListBuilder)
				db.Append(true)
				ddb := db.ValueBuilder().(*array.ListBuilder)
				off := 0
				for t := 0; t < T; t++ {
					n := int(s.DrawN[t])
					ddb.Append(true)
					ddb.ValueBuilder().(*array.Int32Builder).AppendValues(v[off:off+n], nil)
					off += n
				}
			}
			if kind == cache.TargetsHeadSampled {
				tb := b.Field(7).(*array.ListBuilder)
				tb.Append(true)
				tb.ValueBuilder().(*array.Float32Builder).AppendValues(s.TailMass, nil)
			}
		}
		if rows++; rows == exportBatch {
			if err := flush(); err != nil {
				return err
			}
		}
	}
	if err := it.Err(); err != nil {
		return err
	}
	if err := flush(); err != nil {
		return err
	}
	return pw.Close()
}

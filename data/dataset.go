package data

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"sync/atomic"

	"distill/internal/errkind"
)

// Source is one dataset file of a blend.
type Source struct {
	Path string
	// Weight is the source's sampling proportion in a blend (any positive
	// scale: 0.3/0.7 and 3/7 are the same blend). Leave every weight zero to
	// concatenate the sources instead (each record used once, in order).
	Weight float64
	// Format is "jsonl", "csv" or "parquet"; empty picks it from the file
	// extension (.jsonl .ndjson .json -> jsonl, .csv, .parquet .pq).
	Format string
	// Columns renames the fields records are read from.
	Columns ColumnMap
}

// Policy says what happens to a sample longer than Options.MaxLen.
type Policy string

// The length policies.
const (
	// Truncate keeps the first MaxLen tokens. A sample left with no target
	// token (its answer lay beyond MaxLen) is dropped instead.
	Truncate Policy = "truncate"
	// Drop replaces the sample by an empty one with Status Dropped.
	Drop Policy = "drop"
)

// Options control tokenization and indexing. Every field that can change
// the tokens is part of the dataset fingerprint.
type Options struct {
	MaxLen int    // longest sample in tokens; 0 means no limit
	Policy Policy // for samples longer than MaxLen; default Truncate
	// SkipBad turns a bad record (ErrBadRecord, ErrTemplate) into an empty
	// sample with Status Skipped and counts it in Stats, instead of failing.
	SkipBad bool
	// NumSamples is the length of the index; 0 means the number of records of
	// all sources together. A weighted blend reads sources in proportion to
	// their weights, repeating (in a new epoch) a source it exhausts.
	NumSamples int64
	// Shuffle permutes the records of each source (each epoch differently)
	// with a seeded permutation; without it, sources are read in file order.
	Shuffle bool
	Seed    uint64
	// NoEOS stops appending the EOS token to text records and to
	// prompt/response records of tokenizers without a chat template.
	NoEOS bool
	// ChatTemplate overrides the tokenizer's chat template (Jinja source).
	ChatTemplate string
	// TemplateVars are extra template variables, e.g. {"enable_thinking": false}.
	TemplateVars map[string]any
	// Workers is the number of tokenization goroutines; 0 means GOMAXPROCS.
	Workers int
}

// Status says what became of a record.
type Status uint8

// Sample statuses. Samples that are Dropped or Skipped keep their index but
// have no tokens, so indexes never shift when the policy or the data changes.
const (
	OK Status = iota
	Truncated
	Dropped
	Skipped
)

func (s Status) String() string {
	return [...]string{"ok", "truncated", "dropped", "skipped"}[s]
}

// Sample is one tokenized record. Mask[t] = 1 means token t is a training
// target (the loss at position t-1 predicts it), as HF labels != -100.
// Mask[0] is never a target for the first position has no predecessor.
type Sample struct {
	Index  int64   // position in the dataset index
	IDs    []int32 // token ids
	Mask   []uint8 // one 0/1 per id
	Status Status
	Reason string // why a sample was Truncated, Dropped or Skipped
	Source int    // which source the record came from
	Record int64  // record number inside that source
	Loc    string // "file:line" of the record
	why    string // reason category counted in Stats.Reasons
}

// Stats counts what Range produced so far (over all calls, a range read
// twice counts twice).
type Stats struct {
	Samples, Tokens, Targets    int64
	Truncated, Dropped, Skipped int64
	// Reasons counts Dropped and Skipped samples per reason category.
	Reasons map[string]int64
	// Examples holds the first few skip/drop messages, with file:line.
	Examples []string
}

// maxExamples is how many skip/drop messages Stats keeps verbatim.
const maxExamples = 10

// Dataset is a deterministic, randomly accessible index of tokenized samples
// over one or more sources. It is safe for concurrent use.
type Dataset struct {
	sources []reader
	srcs    []Source
	enc     *encoder
	opts    Options
	n       int64
	locate  func(i int64) (int, int64) // sample -> (source, position in source stream)
	perms   []uint64                   // per-source permutation keys (Shuffle)
	mix     *permutation               // Shuffle of concatenated sources: interleaves them
	fp      string

	mu    sync.Mutex
	stats Stats
}

// Open indexes the sources (one streaming pass per file: content hash plus
// record offsets) and prepares tokenization. tmpl renders chat templates; nil
// means the package's default, the tokenizer's own template (or
// Options.ChatTemplate) compiled with distill/data/chattmpl.
func Open(sources []Source, tok Tokenizer, opts Options) (*Dataset, error) {
	return open(sources, tok, nil, opts)
}

func open(sources []Source, tok Tokenizer, tmpl Renderer, opts Options) (*Dataset, error) {
	if len(sources) == 0 {
		return nil, errkind.Errorf(ErrOptions, "no sources")
	}
	if tok == nil {
		return nil, errkind.Errorf(ErrOptions, "no tokenizer")
	}
	if opts.Policy == "" {
		opts.Policy = Truncate
	}
	if opts.Policy != Truncate && opts.Policy != Drop {
		return nil, errkind.Errorf(ErrOptions, "policy %q: want %q or %q", opts.Policy, Truncate, Drop)
	}
	if opts.MaxLen < 0 || opts.NumSamples < 0 || opts.Workers < 0 {
		return nil, errkind.Errorf(ErrOptions, "max-len %d, num-samples %d and workers %d must not be negative", opts.MaxLen, opts.NumSamples, opts.Workers)
	}
	if opts.Workers == 0 {
		opts.Workers = runtime.GOMAXPROCS(0)
	}
	src := opts.ChatTemplate
	if src == "" {
		src = tok.ChatTemplate()
	}
	if tmpl == nil && src != "" {
		var err error
		if tmpl, err = compileTemplate(src, tok.BOS(), tok.EOS()); err != nil {
			return nil, fmt.Errorf("%w: %v", ErrTemplate, err)
		}
	}
	enc, err := newEncoder(tok, tmpl, opts.TemplateVars, opts.NoEOS)
	if err != nil {
		return nil, err
	}
	d := &Dataset{enc: enc, opts: opts, srcs: sources, stats: Stats{Reasons: map[string]int64{}}}
	weighted := 0
	for i, s := range sources {
		if err := s.Columns.Check(); err != nil {
			d.Close()
			return nil, fmt.Errorf("%s: %w", s.Path, err)
		}
		r, err := openSource(s)
		if err != nil {
			d.Close()
			return nil, err
		}
		d.sources = append(d.sources, r)
		if s.Weight != 0 {
			weighted++
		}
		d.perms = append(d.perms, splitmix64(opts.Seed^splitmix64(uint64(i)+1)))
	}
	var total int64
	for _, r := range d.sources {
		total += r.numRecords()
	}
	d.n = opts.NumSamples
	if d.n == 0 {
		d.n = total
	}
	switch weighted {
	case 0:
		c := concat{starts: make([]int64, len(d.sources)+1)}
		for i, r := range d.sources {
			c.starts[i+1] = c.starts[i] + r.numRecords()
		}
		d.locate = c.locate
		if opts.Shuffle && len(sources) > 1 {
			p := newPermutation(uint64(d.n), splitmix64(opts.Seed^0x6d6978))
			d.mix = &p
		}
	case len(sources):
		w := make([]float64, len(sources))
		for i, s := range sources {
			w[i] = s.Weight
		}
		b, err := newBlend(w)
		if err != nil {
			d.Close()
			return nil, err
		}
		d.locate = b.locate
	default:
		d.Close()
		return nil, errkind.Errorf(ErrOptions, "%d of %d sources have a weight: give every source a weight (a blend) or none (concatenation)", weighted, len(sources))
	}
	d.fp = d.fingerprint(src)
	return d, nil
}

func openSource(s Source) (reader, error) {
	// What is not a file is said as such before its extension or format
	// is looked at ("unknown extension" for a directory, "read: is a
	// directory" with a format given).
	switch st, err := os.Stat(s.Path); {
	case errors.Is(err, fs.ErrNotExist):
		return nil, errkind.Errorf(ErrSource, "%s does not exist: check the path", s.Path)
	case err == nil && st.IsDir():
		return nil, errkind.Errorf(ErrSource, "%s is a directory: give the dataset's files (JSONL, CSV or Parquet), e.g. %s", s.Path, filepath.Join(s.Path, "train.jsonl"))
	}
	f := strings.ToLower(s.Format)
	if f == "" {
		switch strings.ToLower(filepath.Ext(s.Path)) {
		case ".jsonl", ".ndjson", ".json":
			f = "jsonl"
		case ".csv":
			f = "csv"
		case ".parquet", ".pq":
			f = "parquet"
		case ".gz", ".zst", ".bz2", ".xz":
			return nil, errkind.Errorf(ErrSource, "%s: compressed files cannot be read at random offsets; decompress it first", s.Path)
		default:
			return nil, errkind.Errorf(ErrSource, "%s: unknown extension %q; set the format to jsonl, csv or parquet", s.Path, filepath.Ext(s.Path))
		}
	}
	cols := s.Columns.withDefaults()
	switch f {
	case "jsonl":
		return openJSONL(s.Path)
	case "csv":
		return openCSV(s.Path, cols)
	case "parquet":
		return openParquet(s.Path, cols)
	}
	return nil, errkind.Errorf(ErrSource, "%s: unknown format %q (want jsonl, csv or parquet)", s.Path, s.Format)
}

// fingerprintVersion changes whenever this package's tokenization rules
// change, so caches built by older code are not mistaken for current ones.
const fingerprintVersion = "distill-data-v1"

// fingerprint hashes everything the tokens depend on.
func (d *Dataset) fingerprint(template string) string {
	type src struct {
		Hash    string
		Format  string
		Weight  float64
		Columns ColumnMap
	}
	fp := struct {
		Version   string
		Tokenizer string
		Template  string
		Sources   []src
		N         int64
		MaxLen    int
		Policy    Policy
		SkipBad   bool
		Shuffle   bool
		Seed      uint64
		NoEOS     bool
		Vars      map[string]any
	}{Version: fingerprintVersion, Tokenizer: d.enc.tok.Fingerprint(), Template: template, N: d.n,
		MaxLen: d.opts.MaxLen, Policy: d.opts.Policy, SkipBad: d.opts.SkipBad, Shuffle: d.opts.Shuffle,
		Seed: d.opts.Seed, NoEOS: d.opts.NoEOS, Vars: d.opts.TemplateVars}
	for i, r := range d.sources {
		h := r.contentHash()
		fp.Sources = append(fp.Sources, src{Hash: hex.EncodeToString(h[:]), Format: fmt.Sprintf("%T", r),
			Weight: d.srcs[i].Weight, Columns: d.srcs[i].Columns.withDefaults()})
	}
	b, err := json.Marshal(fp) // map keys are sorted, so this is canonical
	if err != nil {
		// Only TemplateVars can fail to marshal; hash its printed form.
		fp.Vars = map[string]any{"unmarshalable": fmt.Sprint(d.opts.TemplateVars)}
		b, _ = json.Marshal(fp)
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// Len is the number of samples: the index is i = 0..Len()-1.
func (d *Dataset) Len() int64 { return d.n }

// Fingerprint is a hex SHA-256 over the sources' contents, the tokenizer
// fingerprint, the chat template and every option that affects the tokens.
func (d *Dataset) Fingerprint() string { return d.fp }

// Stats returns a copy of the counters accumulated by Range.
func (d *Dataset) Stats() Stats {
	d.mu.Lock()
	defer d.mu.Unlock()
	s := d.stats
	s.Reasons = make(map[string]int64, len(d.stats.Reasons))
	for k, v := range d.stats.Reasons {
		s.Reasons[k] = v
	}
	s.Examples = append([]string(nil), d.stats.Examples...)
	return s
}

// Close releases the source files.
func (d *Dataset) Close() error {
	var first error
	for _, r := range d.sources {
		if err := r.close(); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// record returns the source and record number of sample i.
func (d *Dataset) record(i int64) (int, int64) {
	if d.mix != nil {
		i = int64(d.mix.apply(uint64(i)))
	}
	s, j := d.locate(i)
	n := d.sources[s].numRecords()
	epoch, r := j/n, j%n
	if d.opts.Shuffle {
		r = int64(newPermutation(uint64(n), d.perms[s]^splitmix64(uint64(epoch))).apply(uint64(r)))
	}
	return s, r
}

// Range tokenizes samples [start, end) on Options.Workers goroutines and
// returns them in index order. Without SkipBad the first bad record (lowest
// index) fails the call; its error names file:line and wraps ErrBadRecord or
// ErrTemplate.
func (d *Dataset) Range(ctx context.Context, start, end int64) ([]Sample, error) {
	if start < 0 || end < start || end > d.n {
		return nil, errkind.Errorf(ErrOptions, "range [%d, %d) is outside the dataset [0, %d)", start, end, d.n)
	}
	out := make([]Sample, end-start)
	errs := make([]error, end-start)
	var next atomic.Int64
	var failed atomic.Bool
	var wg sync.WaitGroup
	for w := 0; w < min(d.opts.Workers, len(out)); w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				k := next.Add(1) - 1
				if k >= int64(len(out)) || ctx.Err() != nil || failed.Load() {
					return
				}
				s, err := d.sample(start + k)
				out[k], errs[k] = s, err
				if err != nil {
					failed.Store(true)
				}
			}
		}()
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	for _, err := range errs {
		if err != nil {
			return nil, err
		}
	}
	d.count(out)
	return out, nil
}

// sample builds sample i. The returned error is fatal (setup or I/O error,
// or a bad record without SkipBad).
func (d *Dataset) sample(i int64) (Sample, error) {
	s, r := d.record(i)
	smp := Sample{Index: i, Source: s, Record: r}
	ids, mask, loc, err := d.tokenize(s, r)
	smp.Loc = loc
	if err != nil {
		var re *RecordError
		if d.opts.SkipBad && errors.As(err, &re) {
			smp.Status, smp.Reason, smp.why = Skipped, err.Error(), re.Reason
			return smp, nil
		}
		return smp, err
	}
	smp.IDs, smp.Mask = ids, mask
	if m := d.opts.MaxLen; m > 0 && len(ids) > m {
		if d.opts.Policy == Drop {
			smp.IDs, smp.Mask = nil, nil
			smp.Status, smp.Reason, smp.why = Dropped, fmt.Sprintf("%s: %d tokens exceed max-len %d", loc, len(ids), m), "longer than max-len"
			return smp, nil
		}
		smp.IDs, smp.Mask = ids[:m:m], mask[:m:m]
		smp.Status, smp.Reason = Truncated, fmt.Sprintf("%s: truncated from %d to %d tokens", loc, len(ids), m)
		if !hasTarget(smp.Mask) {
			smp.IDs, smp.Mask = nil, nil
			smp.Status, smp.Reason, smp.why = Dropped, fmt.Sprintf("%s: no target token within the first %d of %d tokens", loc, m, len(ids)), "no target within max-len"
		}
	}
	return smp, nil
}

func hasTarget(mask []uint8) bool {
	for _, m := range mask {
		if m != 0 {
			return true
		}
	}
	return false
}

func (d *Dataset) tokenize(s int, r int64) ([]int32, []uint8, string, error) {
	obj, loc, err := d.sources[s].read(r)
	if err != nil {
		return nil, nil, loc, err
	}
	rec, err := parseRecord(obj, d.srcs[s].Columns.withDefaults(), d.enc.pretok)
	if err != nil {
		return nil, nil, loc, withLoc(err, loc)
	}
	ids, mask, err := d.enc.encode(rec)
	return ids, mask, loc, withLoc(err, loc)
}

func (d *Dataset) count(out []Sample) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, s := range out {
		d.stats.Add(s)
	}
}

// Add counts sample s: Range's accounting, for callers that count a part
// of the samples (a fill counts each chunk it computes).
func (st *Stats) Add(s Sample) {
	st.Samples++
	switch s.Status {
	case Truncated:
		st.Truncated++
	case Dropped, Skipped:
		if s.Status == Dropped {
			st.Dropped++
		} else {
			st.Skipped++
		}
		if st.Reasons == nil {
			st.Reasons = map[string]int64{}
		}
		st.Reasons[s.why]++
		if len(st.Examples) < maxExamples {
			st.Examples = append(st.Examples, s.Reason)
		}
	}
	st.Tokens += int64(len(s.IDs))
	for _, m := range s.Mask {
		st.Targets += int64(m)
	}
}

// SortedReasons returns the reason categories of s, most frequent first.
func (s Stats) SortedReasons() []string {
	keys := make([]string, 0, len(s.Reasons))
	for k := range s.Reasons {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if s.Reasons[keys[i]] != s.Reasons[keys[j]] {
			return s.Reasons[keys[i]] > s.Reasons[keys[j]]
		}
		return keys[i] < keys[j]
	})
	return keys
}

package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"distill/data"
	"distill/data/tokenizer"
	"distill/internal/cli"
)

func init() {
	commands.Register(&cli.Command{Name: "tokenize", Summary: "tokenize a dataset and print one JSON line per sample (ids, loss mask)", Run: runTokenize})
}

// listFlag is a repeatable string flag.
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(s string) error { *l = append(*l, s); return nil }

func runTokenize(args []string) error {
	return tokenizeMain(args, os.Stdout, os.Stderr)
}

// tokenizeBatch is how many samples are tokenized per Range call: enough to
// keep both cores busy, few enough that memory stays bounded on any file.
const tokenizeBatch = 1024

func tokenizeMain(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("cachectl tokenize", flag.ContinueOnError)
	fs.SetOutput(stderr)
	tokDir := fs.String("tokenizer", "", "directory with tokenizer.json (+ tokenizer_config.json) (required)")
	var files, vars listFlag
	fs.Var(&files, "data", "dataset file: .jsonl, .csv or .parquet (required; repeat for several)")
	weights := fs.String("weights", "", `blend weights, one per --data, e.g. "0.3,0.7" (default: concatenate)`)
	format := fs.String("format", "", "force the format of every --data: jsonl, csv or parquet")
	columns := fs.String("columns", "", `field renames, e.g. "messages=conversations,role=from,content=value"`)
	roles := fs.String("roles", "", `role renames, e.g. "human=user,gpt=assistant"`)
	maxLen := fs.Int("max-len", 0, "longest sample in tokens (0: no limit)")
	policy := fs.String("policy", "truncate", "for samples over --max-len: truncate or drop")
	skipBad := fs.Bool("skip-bad", false, "count and skip bad records instead of failing")
	start := fs.Int64("start", 0, "first sample index")
	end := fs.Int64("end", -1, "end of the sample range (exclusive; -1: all)")
	numSamples := fs.Int64("num-samples", 0, "length of the index (0: number of records)")
	shuffle := fs.Bool("shuffle", false, "shuffle records (seeded, per source and epoch)")
	seed := fs.Uint64("seed", 0, "shuffle seed")
	noEOS := fs.Bool("no-eos", false, "do not append EOS to text and template-less prompt/response records")
	chatTemplate := fs.String("chat-template", "", "file with a Jinja chat template overriding the tokenizer's")
	fs.Var(&vars, "template-var", `extra template variable NAME=JSON, e.g. enable_thinking=false (repeatable)`)
	workers := fs.Int("workers", 0, "tokenization goroutines (0: all cores)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *tokDir == "" || len(files) == 0 {
		fs.Usage()
		return fmt.Errorf("--tokenizer and --data are required")
	}
	if p := data.Policy(*policy); p != data.Truncate && p != data.Drop {
		return fmt.Errorf("%w: --policy %q: want truncate or drop", data.ErrOptions, *policy)
	}
	cols, err := parseColumns(*columns, *roles)
	if err != nil {
		return err
	}
	srcs := make([]data.Source, len(files))
	for i, f := range files {
		srcs[i] = data.Source{Path: f, Format: *format, Columns: cols}
	}
	if *weights != "" {
		ws := strings.Split(*weights, ",")
		if len(ws) != len(files) {
			return fmt.Errorf("--weights has %d values for %d --data files", len(ws), len(files))
		}
		for i, w := range ws {
			v, err := strconv.ParseFloat(strings.TrimSpace(w), 64)
			if err != nil || !(v > 0) {
				return fmt.Errorf("--weights: %q is not a positive number", w)
			}
			srcs[i].Weight = v
		}
	}
	opts := data.Options{MaxLen: *maxLen, Policy: data.Policy(*policy), SkipBad: *skipBad, NumSamples: *numSamples,
		Shuffle: *shuffle, Seed: *seed, NoEOS: *noEOS, Workers: *workers}
	if *chatTemplate != "" {
		b, err := os.ReadFile(*chatTemplate)
		if err != nil {
			return fmt.Errorf("--chat-template: %w", err)
		}
		opts.ChatTemplate = string(b)
	}
	for _, v := range vars {
		name, val, ok := strings.Cut(v, "=")
		var x any
		if !ok || name == "" || json.Unmarshal([]byte(val), &x) != nil {
			return fmt.Errorf("--template-var %q: want NAME=JSON, e.g. enable_thinking=false", v)
		}
		if opts.TemplateVars == nil {
			opts.TemplateVars = map[string]any{}
		}
		opts.TemplateVars[name] = x
	}
	// Flags are checked before the tokenizer loads, which takes a second.
	tok, err := tokenizer.Load(*tokDir)
	if err != nil {
		return err
	}
	d, err := data.Open(srcs, tok, opts)
	if err != nil {
		return err
	}
	defer d.Close()
	if *end < 0 {
		*end = d.Len()
	}
	if *start < 0 || *start > *end || *end > d.Len() {
		return fmt.Errorf("--start %d --end %d: the dataset has samples [0, %d)", *start, *end, d.Len())
	}
	w := bufio.NewWriterSize(stdout, 1<<20)
	type line struct {
		Index  int64   `json:"index"`
		IDs    []int32 `json:"ids"`
		Mask   []int   `json:"mask"` // numbers, not the base64 of []uint8
		Status string  `json:"status,omitempty"`
		Reason string  `json:"reason,omitempty"`
	}
	enc := json.NewEncoder(w)
	ctx := context.Background()
	for a := *start; a < *end; a += tokenizeBatch {
		b := min(a+tokenizeBatch, *end)
		samples, err := d.Range(ctx, a, b)
		if err != nil {
			w.Flush()
			return err
		}
		for _, s := range samples {
			l := line{Index: s.Index, IDs: s.IDs, Mask: maskInts(s.Mask)}
			if l.IDs == nil {
				l.IDs = []int32{}
			}
			if s.Status != data.OK {
				l.Status, l.Reason = s.Status.String(), s.Reason
			}
			if err := enc.Encode(l); err != nil {
				return err
			}
		}
	}
	if err := w.Flush(); err != nil {
		return err
	}
	st := d.Stats()
	fmt.Fprintf(stderr, "tokenize: %d samples [%d, %d) of %d, %d tokens, %d targets; %d truncated, %d dropped, %d skipped; dataset fingerprint %s\n",
		st.Samples, *start, *end, d.Len(), st.Tokens, st.Targets, st.Truncated, st.Dropped, st.Skipped, d.Fingerprint())
	for _, r := range st.SortedReasons() {
		fmt.Fprintf(stderr, "  %6d  %s\n", st.Reasons[r], r)
	}
	for _, e := range st.Examples {
		fmt.Fprintf(stderr, "  e.g. %s\n", e)
	}
	return nil
}

func maskInts(m []uint8) []int {
	out := make([]int, len(m))
	for i, v := range m {
		out[i] = int(v)
	}
	return out
}

// parseColumns reads --columns and --roles into a column mapping.
func parseColumns(columns, roles string) (data.ColumnMap, error) {
	var c data.ColumnMap
	fields := map[string]*string{"messages": &c.Messages, "prompt": &c.Prompt, "response": &c.Response, "system": &c.System,
		"text": &c.Text, "input_ids": &c.InputIDs, "loss_mask": &c.LossMask, "role": &c.Role, "content": &c.Content}
	for _, kv := range strings.Split(columns, ",") {
		if strings.TrimSpace(kv) == "" {
			continue
		}
		k, v, ok := strings.Cut(kv, "=")
		p := fields[strings.TrimSpace(k)]
		if !ok || p == nil || strings.TrimSpace(v) == "" {
			return c, fmt.Errorf("--columns %q: want FIELD=NAME with FIELD one of messages, prompt, response, system, text, input_ids, loss_mask, role, content", kv)
		}
		*p = strings.TrimSpace(v)
	}
	for _, kv := range strings.Split(roles, ",") {
		if strings.TrimSpace(kv) == "" {
			continue
		}
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" || v == "" {
			return c, fmt.Errorf("--roles %q: want DATASET_ROLE=ROLE, e.g. human=user", kv)
		}
		if c.Roles == nil {
			c.Roles = map[string]string{}
		}
		c.Roles[strings.TrimSpace(k)] = strings.TrimSpace(v)
	}
	return c, nil
}

package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"

	"distill/data"
	"distill/internal/cli"
)

// datasetFlags are the dataset options of the commands that read a dataset
// (fill, tokenize): one registration and one validation, so that both
// spell them and check them alike, and a dataset tokenize shows is the one
// fill computes.
type datasetFlags struct {
	data, vars                      listFlag
	weights, format, columns, roles string
	policy, chatTemplate            string
	maxLen                          int
	numSamples                      int64
	seed                            uint64
	skipBad, shuffle, noEOS         bool
}

// listFlag is a repeatable string flag.
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(s string) error { *l = append(*l, s); return nil }

// register defines the dataset flags on fs. where says whose view of the
// paths counts (fill's daemons read their own files).
func (f *datasetFlags) register(fs *flag.FlagSet, where string) {
	fs.Var(&f.data, "data", "dataset file PATH[,PATH...]: .jsonl, .csv or .parquet, "+where+" (required; repeatable)")
	fs.StringVar(&f.weights, "weights", "", `blend weights W[,W...], one per --data file, e.g. "0.3,0.7" (default: concatenate)`)
	fs.StringVar(&f.format, "format", "", "format of every --data file: jsonl, csv or parquet (default: from each file's extension)")
	fs.StringVar(&f.columns, "columns", "", `field renames FIELD=NAME[,...], e.g. "messages=conversations,role=from,content=value"`)
	fs.StringVar(&f.roles, "roles", "", `role renames DATASET_ROLE=ROLE[,...], e.g. "human=user,gpt=assistant"`)
	fs.IntVar(&f.maxLen, "max-len", 0, "longest sample in tokens (0: no limit)")
	fs.StringVar(&f.policy, "policy", "truncate", "samples over --max-len: truncate or drop")
	fs.BoolVar(&f.skipBad, "skip-bad", false, "store bad records as empty samples and count them, instead of failing")
	fs.Int64Var(&f.numSamples, "num-samples", 0, "samples in the index (0: all records)")
	fs.BoolVar(&f.shuffle, "shuffle", false, "permute the records (seeded, per source and epoch)")
	fs.Uint64Var(&f.seed, "seed", 0, "shuffle seed")
	fs.BoolVar(&f.noEOS, "no-eos", false, "do not append EOS to text and template-less prompt/response records")
	fs.StringVar(&f.chatTemplate, "chat-template", "", "file with a Jinja chat template overriding the tokenizer's")
	fs.Var(&f.vars, "template-var", "extra chat-template variable NAME=JSON, e.g. enable_thinking=false (repeatable)")
}

// dataset checks the flags and returns the sources and options they
// describe (Options.Workers is left 0). Every error names the flag.
func (f *datasetFlags) dataset() ([]data.Source, data.Options, error) {
	var paths []string
	for _, v := range f.data {
		for _, p := range strings.Split(v, ",") {
			if p = strings.TrimSpace(p); p == "" {
				return nil, data.Options{}, optionErrorf("--data %q: empty path", v)
			}
			paths = append(paths, p)
		}
	}
	if len(paths) == 0 {
		return nil, data.Options{}, optionErrorf("--data is required: give the dataset files")
	}
	switch f.format {
	case "", "jsonl", "csv", "parquet":
	default:
		return nil, data.Options{}, optionErrorf("--format %q: want jsonl, csv or parquet (or leave it out: from the extension)", f.format)
	}
	cols, err := parseColumns(f.columns, f.roles)
	if err != nil {
		return nil, data.Options{}, err
	}
	srcs := make([]data.Source, len(paths))
	for i, p := range paths {
		srcs[i] = data.Source{Path: p, Format: f.format, Columns: cols}
	}
	if f.weights != "" {
		ws := strings.Split(f.weights, ",")
		if len(ws) != len(paths) {
			return nil, data.Options{}, optionErrorf("--weights has %d values for %d --data files: give one per file", len(ws), len(paths))
		}
		for i, w := range ws {
			v, err := strconv.ParseFloat(strings.TrimSpace(w), 64)
			if err != nil || !(v > 0) || math.IsInf(v, 1) {
				return nil, data.Options{}, optionErrorf("--weights: %q is not a positive number", w)
			}
			srcs[i].Weight = v
		}
	}
	if f.maxLen < 0 {
		return nil, data.Options{}, optionErrorf("--max-len %d: want 0 (no limit) or a positive token count", f.maxLen)
	}
	if p := data.Policy(f.policy); p != data.Truncate && p != data.Drop {
		return nil, data.Options{}, optionErrorf("--policy %q: want truncate or drop", f.policy)
	}
	if f.numSamples < 0 {
		return nil, data.Options{}, optionErrorf("--num-samples %d: want 0 (all records) or a positive count", f.numSamples)
	}
	opts := data.Options{MaxLen: f.maxLen, Policy: data.Policy(f.policy), SkipBad: f.skipBad, NumSamples: f.numSamples,
		Shuffle: f.shuffle, Seed: f.seed, NoEOS: f.noEOS}
	if f.chatTemplate != "" {
		b, err := os.ReadFile(f.chatTemplate)
		if err != nil {
			return nil, data.Options{}, fmt.Errorf("--chat-template: %w", err)
		}
		opts.ChatTemplate = string(b)
	}
	for _, v := range f.vars {
		name, val, ok := strings.Cut(v, "=")
		var x any
		if !ok || strings.TrimSpace(name) == "" || json.Unmarshal([]byte(val), &x) != nil {
			return nil, data.Options{}, optionErrorf("--template-var %q: want NAME=JSON, e.g. enable_thinking=false or name='\"x\"'", v)
		}
		if opts.TemplateVars == nil {
			opts.TemplateVars = map[string]any{}
		}
		opts.TemplateVars[strings.TrimSpace(name)] = x
	}
	return srcs, opts, nil
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
			return c, optionErrorf("--columns %q: want FIELD=NAME with FIELD one of messages, prompt, response, system, text, input_ids, loss_mask, role, content", kv)
		}
		*p = strings.TrimSpace(v)
	}
	for _, kv := range strings.Split(roles, ",") {
		if strings.TrimSpace(kv) == "" {
			continue
		}
		k, v, ok := strings.Cut(kv, "=")
		k, v = strings.TrimSpace(k), strings.TrimSpace(v)
		if !ok || k == "" || v == "" {
			return c, optionErrorf("--roles %q: want DATASET_ROLE=ROLE, e.g. human=user", kv)
		}
		if c.Roles == nil {
			c.Roles = map[string]string{}
		}
		c.Roles[k] = v
	}
	if err := c.Check(); err != nil {
		return c, cli.Usagef("--roles %q: %w", roles, err)
	}
	return c, nil
}

// optionError is a bad dataset flag: its message names the flag, and it
// is a data.ErrOptions, as the same mistake in a config is.
type optionError string

func (e optionError) Error() string { return string(e) }
func (e optionError) Unwrap() error { return data.ErrOptions }

// optionErrorf is an optionError that is also a usage error (exit 2):
// every one is what the flags alone get wrong.
func optionErrorf(format string, a ...any) error {
	return cli.Usage(optionError(fmt.Sprintf(format, a...)))
}

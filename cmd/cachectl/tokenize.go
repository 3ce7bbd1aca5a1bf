package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"

	"distill/data"
	"distill/data/tokenizer"
	"distill/internal/cli"
)

func init() {
	commands.Register(&cli.Command{Name: "tokenize", Summary: "tokenize a dataset and print one JSON line per sample (ids, loss mask)", Run: runTokenize})
}

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
	var df datasetFlags
	df.register(fs, "as this machine sees them")
	start := fs.Int64("start", 0, "first sample index")
	end := fs.Int64("end", 0, "one past the last sample (0: the dataset's length)")
	workers := fs.Int("workers", 0, "tokenization goroutines (0: all cores)")
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return cli.Usagef("unexpected arguments %q (flags come as --name value)", fs.Args())
	}
	if *tokDir == "" {
		return cli.Usagef("--tokenizer is required: the directory with tokenizer.json")
	}
	srcs, opts, err := df.dataset()
	if err != nil {
		return err
	}
	if *workers < 0 {
		return cli.Usagef("--workers %d: want 0 (all cores) or a positive count", *workers)
	}
	// What the command line alone gets wrong is a usage error, as fill's
	// (it exited 1, after the tokenizer and the dataset had loaded).
	if *start < 0 || (*end != 0 && *end <= *start) {
		return cli.Usagef("--start %d --end %d: want 0 <= --start < --end (--end 0: the dataset's length)", *start, *end)
	}
	opts.Workers = *workers
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
	switch {
	case *end > d.Len():
		return fmt.Errorf("--end %d: the dataset has samples [0, %d)", *end, d.Len())
	case *end == 0 && *start > 0 && *start >= d.Len():
		// Not "--start 200 --end 120": the user gave no --end.
		return fmt.Errorf("--start %d: the dataset has samples [0, %d)", *start, d.Len())
	case *end == 0:
		*end = d.Len()
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

package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"distill/cache"
	"distill/internal/cli"
)

func init() {
	commands.Register(&cli.Command{Name: "status", Summary: "show a cache: manifest, ranges done/missing, samples, tokens, bytes, bytes/token", Run: func(args []string) error {
		return statusMain(args, os.Stdout, os.Stderr)
	}})
}

// cacheStatus is the --json form of `cachectl status`.
type cacheStatus struct {
	Manifest      cache.Manifest `json:"manifest"`
	Dirs          []string       `json:"dirs"`
	Chunks        int            `json:"chunks"`
	SamplesDone   int64          `json:"samples_done"`
	Missing       []cache.Range  `json:"missing"`
	Tokens        int64          `json:"tokens"`
	Bytes         int64          `json:"bytes"`
	BytesPerToken float64        `json:"bytes_per_token"`
	// BytesPerEntry is BytesPerToken / k, top-k caches only: a sampled
	// kind's bytes are mostly its draws, and a sampled cache has k 0 (the
	// division made +Inf, which encoding/json refuses).
	BytesPerEntry float64 `json:"bytes_per_entry,omitempty"`
	// Computing are the ranges live writers (fills, daemons) have
	// claimed and are computing now: missing, but not for long.
	Computing []computing `json:"computing"`
}

// computing is a live writer's claim (cache.Claim) in --json.
type computing struct {
	Dir    string    `json:"dir"`
	Start  int64     `json:"start"`
	End    int64     `json:"end"`
	PID    int       `json:"pid"`
	Host   string    `json:"host"`
	Since  time.Time `json:"since"`
	Writer string    `json:"writer"`
}

func statusMain(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("cachectl status", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var dirs cacheDirs
	fs.Var(&dirs, "cache", "cache directory (repeat or comma-separate to read several as one)")
	asJSON := fs.Bool("json", false, "print JSON")
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	if err := noArgs(fs); err != nil {
		return err
	}
	r, err := openCacheReader(dirs)
	if err != nil {
		return err
	}
	st := cacheStatus{Manifest: r.Manifest(), Dirs: dirs, Chunks: len(r.Chunks()), SamplesDone: r.Samples(), Missing: r.Missing()}
	for _, c := range r.Chunks() {
		st.Tokens += c.Tokens
		st.Bytes += c.Bytes
	}
	if st.Tokens > 0 {
		st.BytesPerToken = float64(st.Bytes) / float64(st.Tokens)
		if !st.Manifest.Sampled() && st.Manifest.K > 0 {
			st.BytesPerEntry = st.BytesPerToken / float64(st.Manifest.K)
		}
	}
	if st.Missing == nil {
		st.Missing = []cache.Range{}
	}
	st.Computing = []computing{}
	for _, d := range dirs {
		cl, err := cache.Claims(d)
		if err != nil {
			return err
		}
		for _, c := range cl {
			st.Computing = append(st.Computing, computing{Dir: d, Start: c.Range.Start, End: c.Range.End, PID: c.PID, Host: c.Host, Since: c.Since, Writer: c.Writer})
		}
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(st)
	}
	m := st.Manifest
	fmt.Fprintf(stdout, "cache      %v\n", dirs)
	fmt.Fprintf(stdout, "format     v%d, encoding %s, k %d, vocab %d, temperature %g", m.FormatVersion, m.Encoding, m.K, m.VocabSize, m.Temperature)
	if m.Sampled() {
		fmt.Fprintf(stdout, ", targets %s, %d draws", m.Kind(), m.Draws)
	}
	fmt.Fprintln(stdout)
	fmt.Fprintf(stdout, "teacher    %s\ntokenizer  %s\ndataset    %s\n", m.TeacherFingerprint, m.TokenizerFingerprint, m.DatasetFingerprint)
	fmt.Fprintf(stdout, "samples    %d of %d done (%.1f%%) in %d chunks\n", st.SamplesDone, m.Samples, 100*float64(st.SamplesDone)/float64(m.Samples), st.Chunks)
	fmt.Fprintf(stdout, "missing    %s\n", formatRanges(st.Missing, 20))
	if len(st.Computing) > 0 {
		var rs []string
		for i, c := range st.Computing {
			if i == 20 {
				rs = append(rs, fmt.Sprintf("... (%d more)", len(st.Computing)-20))
				break
			}
			rs = append(rs, fmt.Sprintf("[%d, %d) by pid %d on %s since %s", c.Start, c.End, c.PID, c.Host, c.Since.Format(time.DateTime)))
		}
		fmt.Fprintf(stdout, "computing  %s\n", strings.Join(rs, "; "))
	}
	fmt.Fprintf(stdout, "tokens     %d\n", st.Tokens)
	if st.BytesPerEntry > 0 {
		fmt.Fprintf(stdout, "bytes      %d (%.1f B/token, %.3f B per top-k entry)\n", st.Bytes, st.BytesPerToken, st.BytesPerEntry)
	} else {
		fmt.Fprintf(stdout, "bytes      %d (%.1f B/token)\n", st.Bytes, st.BytesPerToken)
	}
	return nil
}

package main

import (
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"strconv"

	"distill/cache"
	"distill/data/tokenizer"
	"distill/internal/cli"
)

func init() {
	commands.Register(&cli.Command{Name: "inspect", Summary: "print one cached sample: tokens, loss mask, top-k ids and probabilities, drawn ids and their targets", Run: func(args []string) error {
		return inspectMain(args, os.Stdout, os.Stderr)
	}})
}

func inspectMain(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("cachectl inspect", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var dirs cacheDirs
	fs.Var(&dirs, "cache", "cache directory (repeatable)")
	index := fs.Int64("sample", 0, "sample index (required)")
	top := fs.Int("top", 5, "top-k entries (and drawn ids, most drawn first) to print per position (0: all)")
	from := fs.Int("from", 0, "first position to print")
	count := fs.Int("positions", 0, "positions to print (0: all)")
	tokDir := fs.String("tokenizer", "", "tokenizer directory (tokenizer.json); decodes tokens and top-k ids")
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	if err := noArgs(fs); err != nil {
		return err
	}
	sampleSet := false
	fs.Visit(func(f *flag.Flag) { sampleSet = sampleSet || f.Name == "sample" })
	if !sampleSet {
		return cli.Usagef("--sample INDEX is required")
	}
	if *index < 0 {
		// It said "--sample INDEX is required" of a --sample given.
		return cli.Usagef("--sample %d: want a sample index, 0 or more", *index)
	}
	// A negative --from printed no position at all (its window ended
	// before 0), and negative counts read as "all" unsaid.
	for _, f := range []struct {
		name string
		v    int
		zero string
	}{{"from", *from, "the first position"}, {"positions", *count, "all"}, {"top", *top, "all"}} {
		if f.v < 0 {
			return cli.Usagef("--%s %d: want 0 (%s) or more", f.name, f.v, f.zero)
		}
	}
	r, err := openCacheReader(dirs)
	if err != nil {
		return err
	}
	m := r.Manifest()
	var tok *tokenizer.Tokenizer
	if *tokDir != "" {
		if tok, err = tokenizer.Load(*tokDir); err != nil {
			return err
		}
		if tok.Fingerprint() != m.TokenizerFingerprint {
			fmt.Fprintf(stderr, "warning: tokenizer %s has fingerprint %s, the cache was made with %s; decoded text may be wrong\n", *tokDir, tok.Fingerprint(), m.TokenizerFingerprint)
		}
	}
	s, err := r.Get(*index)
	if err != nil {
		return err
	}
	T, K := len(s.Tokens), m.K
	if *from > 0 && *from >= T {
		// Only the header printed, as if the sample had no positions.
		if T == 0 {
			return fmt.Errorf("--from %d: sample %d has no positions (an empty sample)", *from, s.Index)
		}
		return fmt.Errorf("--from %d: sample %d has %d positions (0 to %d)", *from, s.Index, T, T-1)
	}
	str := func(id int32) string {
		if tok == nil {
			return ""
		}
		return " " + strconv.Quote(tok.Decode([]int32{id}))
	}
	kind := m.Kind()
	draws := ""
	if kind != cache.TargetsTopK {
		draws = fmt.Sprintf(", %d draws a position", m.Draws)
	}
	fmt.Fprintf(stdout, "sample %d: %d tokens, %d in the loss, targets %s, k %d%s, encoding %s\n", s.Index, T, countOnes(s.Mask), kind, K, draws, m.Encoding)
	if tok != nil {
		fmt.Fprintf(stdout, "text: %s\n", strconv.Quote(tok.Decode(s.Tokens)))
	}
	n := *top
	if n <= 0 || n > K {
		n = K
	}
	end := T
	if *count > 0 {
		end = min(T, *from+*count)
	}
	off := make([]int, T+1) // where each position's draws start
	for t := range s.DrawN {
		off[t+1] = off[t] + int(s.DrawN[t])
	}
	for t := *from; t < end; t++ {
		next := "(end)"
		if t+1 < T {
			next = fmt.Sprintf("%d%s", s.Tokens[t+1], str(s.Tokens[t+1]))
		}
		switch kind {
		case cache.TargetsTopK:
			mass := 0.0
			for j := 0; j < K; j++ {
				mass += math.Exp(float64(s.TopKLogProbs[t*K+j]))
			}
			fmt.Fprintf(stdout, "pos %d token %d%s mask %d next %s tail %.4f\n", t, s.Tokens[t], str(s.Tokens[t]), s.Mask[t], next, max(0, 1-mass))
		case cache.TargetsSampled:
			fmt.Fprintf(stdout, "pos %d token %d%s mask %d next %s drawn ids %d\n", t, s.Tokens[t], str(s.Tokens[t]), s.Mask[t], next, s.DrawN[t])
		default:
			fmt.Fprintf(stdout, "pos %d token %d%s mask %d next %s tail %.4f drawn ids %d\n", t, s.Tokens[t], str(s.Tokens[t]), s.Mask[t], next, s.TailMass[t], s.DrawN[t])
		}
		for j := 0; j < n; j++ {
			lp := s.TopKLogProbs[t*K+j]
			fmt.Fprintf(stdout, "   %2d  id %-7d p %.5f  logp %9.4f%s\n", j, s.TopKIDs[t*K+j], math.Exp(float64(lp)), lp, str(s.TopKIDs[t*K+j]))
		}
		if kind == cache.TargetsTopK {
			continue
		}
		// The drawn ids, most drawn first, with the target each trains
		// toward: count/N, or (head+sampled) tail·count/N.
		w := 1 / float64(m.Draws)
		if kind == cache.TargetsHeadSampled {
			w *= float64(s.TailMass[t])
		}
		d := off[t+1] - off[t]
		if *top > 0 {
			d = min(d, *top)
		}
		for j := off[t]; j < off[t]+d; j++ {
			fmt.Fprintf(stdout, "   drawn  id %-7d count %-4d target %.5f%s\n", s.DrawIDs[j], s.DrawCounts[j], w*float64(s.DrawCounts[j]), str(s.DrawIDs[j]))
		}
	}
	return nil
}

func countOnes(m []uint8) int {
	n := 0
	for _, v := range m {
		n += int(v)
	}
	return n
}

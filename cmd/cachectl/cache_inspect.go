package main

import (
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"strconv"

	"distill/data/tokenizer"
	"distill/internal/cli"
)

func init() {
	commands.Register(&cli.Command{Name: "inspect", Summary: "print one cached sample: tokens, loss mask, top-k ids and probabilities", Run: func(args []string) error {
		return inspectMain(args, os.Stdout, os.Stderr)
	}})
}

func inspectMain(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("cachectl inspect", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var dirs cacheDirs
	fs.Var(&dirs, "cache", "cache directory (repeatable)")
	index := fs.Int64("sample", -1, "sample index (required)")
	top := fs.Int("top", 5, "top-k entries to print per position (0: all k)")
	from := fs.Int("from", 0, "first position to print")
	count := fs.Int("positions", 0, "positions to print (0: all)")
	tokDir := fs.String("tokenizer", "", "tokenizer directory (tokenizer.json); decodes tokens and top-k ids")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *index < 0 {
		return fmt.Errorf("--sample INDEX is required")
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
	str := func(id int32) string {
		if tok == nil {
			return ""
		}
		return " " + strconv.Quote(tok.Decode([]int32{id}))
	}
	fmt.Fprintf(stdout, "sample %d: %d tokens, %d in the loss, k %d, encoding %s\n", s.Index, T, countOnes(s.Mask), K, m.Encoding)
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
	for t := max(*from, 0); t < end; t++ {
		mass := 0.0
		for j := 0; j < K; j++ {
			mass += math.Exp(float64(s.TopKLogProbs[t*K+j]))
		}
		next := "(end)"
		if t+1 < T {
			next = fmt.Sprintf("%d%s", s.Tokens[t+1], str(s.Tokens[t+1]))
		}
		fmt.Fprintf(stdout, "pos %d token %d%s mask %d next %s tail %.4f\n", t, s.Tokens[t], str(s.Tokens[t]), s.Mask[t], next, max(0, 1-mass))
		for j := 0; j < n; j++ {
			lp := s.TopKLogProbs[t*K+j]
			fmt.Fprintf(stdout, "   %2d  id %-7d p %.5f  logp %9.4f%s\n", j, s.TopKIDs[t*K+j], math.Exp(float64(lp)), lp, str(s.TopKIDs[t*K+j]))
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

package main

import (
	"flag"
	"fmt"
	"io"
	"strings"

	"distill/cache"
	"distill/internal/cli"
)

// cacheDirs is a repeatable --cache flag; several directories filled by
// different teachers open as one cache.
type cacheDirs []string

func (d *cacheDirs) String() string { return strings.Join(*d, ",") }

func (d *cacheDirs) Set(s string) error {
	for _, p := range strings.Split(s, ",") {
		if p != "" {
			*d = append(*d, p)
		}
	}
	return nil
}

// noArgs refuses positional arguments: the commands take flags only, and
// a stray word (a second directory without its --cache, a misspelled
// flag value) was silently ignored.
func noArgs(fs *flag.FlagSet) error {
	if fs.NArg() > 0 {
		return cli.Usagef("unexpected arguments %q (flags come as --name value)", fs.Args())
	}
	return nil
}

func openCacheReader(dirs cacheDirs) (*cache.Reader, error) {
	if len(dirs) == 0 {
		return nil, cli.Usagef("--cache DIR is required (repeat it to read several directories as one cache)")
	}
	return cache.OpenReader(dirs...)
}

// formatRanges prints ranges compactly, at most limit of them.
func formatRanges(rs []cache.Range, limit int) string {
	if len(rs) == 0 {
		return "none"
	}
	var b strings.Builder
	for i, r := range rs {
		if i == limit {
			fmt.Fprintf(&b, " ... (%d more)", len(rs)-limit)
			break
		}
		if i > 0 {
			b.WriteString(" ")
		}
		b.WriteString(r.String())
	}
	return b.String()
}

// parseOneCache parses the flags of a command that changes one cache
// directory (gc, repair, reset): --cache DIR is required, and extra
// registers the command's other flags.
func parseOneCache(name string, args []string, stderr io.Writer, extra func(*flag.FlagSet)) (string, error) {
	fs := flag.NewFlagSet("cachectl "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("cache", "", "cache directory (required)")
	if extra != nil {
		extra(fs)
	}
	if err := cli.ParseFlags(fs, args); err != nil {
		return "", err
	}
	if *dir == "" {
		return "", cli.Usagef("--cache DIR is required")
	}
	if err := noArgs(fs); err != nil {
		return "", err
	}
	return *dir, nil
}

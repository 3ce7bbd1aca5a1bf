package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"distill/cache"
	"distill/internal/cli"
)

func init() {
	commands.Register(&cli.Command{Name: "verify", Summary: "fsck a cache: every index entry points at a complete chunk with matching checksum and rows", Run: func(args []string) error {
		return verifyMain(args, os.Stdout, os.Stderr)
	}})
}

func verifyMain(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("cachectl verify", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var dirs cacheDirs
	fs.Var(&dirs, "cache", "cache directory (repeatable)")
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	if err := noArgs(fs); err != nil {
		return err
	}
	if len(dirs) == 0 {
		return cli.Usagef("--cache DIR is required")
	}
	problems, chunkProblems := 0, 0
	for _, d := range dirs {
		rep, err := cache.Check(d, nil)
		if err != nil {
			return err
		}
		for _, p := range rep.Problems {
			fmt.Fprintf(stdout, "%s: %s\n", d, p)
		}
		problems += len(rep.Problems)
		chunkProblems += len(rep.Problems)
		fmt.Fprintf(stdout, "%s: %d chunks, %d samples, %d tokens, %d bytes checked: %s\n", d, rep.Chunks, rep.Samples, rep.Tokens, rep.Bytes, count(len(rep.Problems), "problem"))
	}
	mismatch := false
	if len(dirs) > 1 {
		if _, err := cache.OpenReader(dirs...); err != nil {
			fmt.Fprintf(stdout, "directories do not form one cache: %v\n", err)
			problems++
			mismatch = true
		}
	}
	// Each kind of problem with its own way out: repair mends a
	// directory's chunks, not directories that are not one cache.
	var fixes []string
	if chunkProblems > 0 {
		fixes = append(fixes, "cachectl repair --cache DIR drops the records of missing or corrupt chunks, then the same fill recomputes those ranges")
	}
	if mismatch {
		fixes = append(fixes, "give --cache only directories of one teacher's fills of one dataset (cachectl status --cache DIR shows each one's manifest)")
	}
	if problems > 0 {
		return fmt.Errorf("%s found; %s", count(problems, "problem"), strings.Join(fixes, "; "))
	}
	return nil
}

// count is "1 problem", "3 problems".
func count(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

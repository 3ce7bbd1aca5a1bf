package main

import (
	"flag"
	"fmt"
	"io"
	"os"

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
	problems := 0
	for _, d := range dirs {
		rep, err := cache.Check(d, nil)
		if err != nil {
			return err
		}
		for _, p := range rep.Problems {
			fmt.Fprintf(stdout, "%s: %s\n", d, p)
		}
		problems += len(rep.Problems)
		fmt.Fprintf(stdout, "%s: %d chunks, %d samples, %d tokens, %d bytes checked: %d problems\n", d, rep.Chunks, rep.Samples, rep.Tokens, rep.Bytes, len(rep.Problems))
	}
	if len(dirs) > 1 {
		if _, err := cache.OpenReader(dirs...); err != nil {
			fmt.Fprintf(stdout, "directories do not form one cache: %v\n", err)
			problems++
		}
	}
	if problems > 0 {
		return fmt.Errorf("%d problems found; cachectl repair --cache DIR drops the records of missing or corrupt chunks, then the same fill recomputes those ranges", problems)
	}
	return nil
}

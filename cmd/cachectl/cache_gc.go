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
	commands.Register(&cli.Command{Name: "gc", Summary: "remove chunk files and temporary files left by crashed writers", Run: func(args []string) error {
		return gcMain(args, os.Stdout, os.Stderr)
	}})
}

func gcMain(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("cachectl gc", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("cache", "", "cache directory (required)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *dir == "" {
		return fmt.Errorf("--cache DIR is required")
	}
	c, err := cache.Open(*dir, nil) // Open runs GC under the exclusive lock
	if err != nil {
		return err
	}
	defer c.Close()
	rep := c.OpenGC()
	for _, f := range rep.Files {
		fmt.Fprintf(stdout, "removed %s\n", f)
	}
	fmt.Fprintf(stdout, "%s: removed %d files\n", *dir, len(rep.Files))
	return nil
}

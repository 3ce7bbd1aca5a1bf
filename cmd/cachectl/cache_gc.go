package main

import (
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
	dir, err := parseOneCache("gc", args, stderr, nil)
	if err != nil {
		return err
	}
	c, err := cache.Open(dir, nil) // Open runs GC under the exclusive lock
	if err != nil {
		return err
	}
	defer c.Close()
	rep := c.OpenGC()
	for _, f := range rep.Files {
		fmt.Fprintf(stdout, "removed %s\n", f)
	}
	fmt.Fprintf(stdout, "%s: removed %d files\n", dir, len(rep.Files))
	return nil
}

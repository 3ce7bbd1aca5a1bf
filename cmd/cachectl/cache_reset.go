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
	commands.Register(&cli.Command{Name: "reset", Summary: "make a cache with no committed chunk an empty directory again (--force: discard committed chunks too)", Run: func(args []string) error {
		return resetMain(args, os.Stdout, os.Stderr)
	}})
}

func resetMain(args []string, stdout, stderr io.Writer) error {
	var force bool
	dir, err := parseOneCache("reset", args, stderr, func(fs *flag.FlagSet) {
		fs.BoolVar(&force, "force", false, "also delete the committed chunks (their data is lost)")
	})
	if err != nil {
		return err
	}
	rep, err := cache.Reset(dir, force, nil)
	for _, f := range rep.Files {
		fmt.Fprintf(stdout, "removed %s\n", f)
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "%s: reset (manifest of dataset %s removed; %d committed chunks, %d samples discarded); the next fill creates the cache anew\n",
		dir, rep.Manifest.DatasetFingerprint, rep.Chunks, rep.Samples)
	return nil
}

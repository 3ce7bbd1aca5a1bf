package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"distill/cache"
	"distill/internal/cli"
)

func init() {
	commands.Register(&cli.Command{Name: "reset", Summary: "delete a cache with no committed chunk (index, chunks, temporary files) so the next fill starts anew (--force: discard committed chunks too)", Run: func(args []string) error {
		return resetMain(args, os.Stdout, os.Stderr)
	}})
}

func resetMain(args []string, stdout, stderr io.Writer) error {
	var force bool
	dir, err := parseOneCache("reset", args, stderr, func(fs *flag.FlagSet) {
		fs.BoolVar(&force, "force", false, "also delete the committed chunks (their data is lost), or the chunk files of a directory whose index/ is lost")
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
	if rep.IndexLost {
		fmt.Fprintf(stdout, "%s: reset (it had no index; %d files removed); the next fill creates the cache anew\n", dir, len(rep.Files))
	} else {
		fmt.Fprintf(stdout, "%s: reset (manifest of dataset %s removed; %d committed chunks, %d samples discarded); the next fill creates the cache anew\n",
			dir, rep.Manifest.DatasetFingerprint, rep.Chunks, rep.Samples)
	}
	printLeft(stdout, dir)
	return nil
}

// printLeft says what dir still holds after a reset, so that nobody takes
// it for an empty directory. Reset keeps LOCK, chunks/ and tmp/: a fill or
// reader that opened LOCK before the reset would hold a flock on a removed
// file while the next process locks a new one, and a fill starting
// meanwhile has already made chunks/ and tmp/ and publishes into them.
// Anything else was not written by cachectl and is left alone.
func printLeft(w io.Writer, dir string) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		fmt.Fprintf(w, "%s: cannot list what is left: %v\n", dir, err)
		return
	}
	var ours, others []string
	for _, e := range ents {
		n := e.Name()
		switch {
		case n == "LOCK" && !e.IsDir():
			ours = append(ours, n)
		case (n == "chunks" || n == "tmp") && e.IsDir():
			sub, err := os.ReadDir(filepath.Join(dir, n))
			switch {
			case err != nil:
				ours = append(ours, fmt.Sprintf("%s/ (%v)", n, err))
			case len(sub) == 0:
				ours = append(ours, n+"/ (empty)")
			default:
				ours = append(ours, fmt.Sprintf("%s/ (%d entries, made since the reset)", n, len(sub)))
			}
		default:
			if e.IsDir() {
				n += "/"
			}
			others = append(others, n)
		}
	}
	if len(ours) > 0 {
		fmt.Fprintf(w, "%s: left: %s: the cache's lock file and directories, kept in case a fill or reader starts meanwhile; delete them once none uses %s\n", dir, strings.Join(ours, ", "), dir)
	}
	if len(others) > 0 {
		fmt.Fprintf(w, "%s: also left, not written by cachectl: %s\n", dir, strings.Join(others, ", "))
	}
	if len(ours)+len(others) == 0 {
		fmt.Fprintf(w, "%s: left empty\n", dir)
	}
}

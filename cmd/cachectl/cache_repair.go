package main

import (
	"fmt"
	"io"
	"os"

	"distill/cache"
	"distill/internal/cli"
)

func init() {
	commands.Register(&cli.Command{Name: "repair", Summary: "drop the index records of missing or corrupt chunks, so that a fill recomputes exactly those ranges", Run: func(args []string) error {
		return repairMain(args, os.Stdout, os.Stderr)
	}})
}

func repairMain(args []string, stdout, stderr io.Writer) error {
	dir, err := parseOneCache("repair", args, stderr, nil)
	if err != nil {
		return err
	}
	rep, err := cache.Repair(dir, nil)
	if rep != nil {
		for i, d := range rep.Dropped {
			fmt.Fprintf(stdout, "dropped %v (%s): %s\n", d.Range, d.File, rep.Problems[i])
		}
		for _, f := range rep.Files {
			fmt.Fprintf(stdout, "removed %s\n", f)
		}
	}
	if err != nil {
		return err
	}
	var samples int64
	for _, d := range rep.Dropped {
		samples += d.Len()
	}
	fmt.Fprintf(stdout, "%s: %d chunks checked, %d dropped (%d samples), %d rekeyed, %d stray sample keys removed\n",
		dir, rep.Checked, len(rep.Dropped), samples, rep.Rekeyed, rep.StrayKeys)
	if len(rep.Dropped) > 0 {
		fmt.Fprintf(stdout, "run the same fill again: it recomputes exactly the dropped ranges\n")
	}
	return nil
}

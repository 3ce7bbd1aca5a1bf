package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"distill/cache"
	"distill/internal/cli"
)

// TestExportOutWholeOrNothing: an export to --out that fails halfway (a
// damaged chunk) leaves no file: it left an empty JSONL file, or a
// 4-byte Parquet file no reader opens, and an existing --out truncated.
// An --out that cannot be written is named as --out, before the cache is
// read; a directory is refused; a device (/dev/null) is written as it is.
func TestExportOutWholeOrNothing(t *testing.T) {
	a, _ := makeCtlCaches(t, cache.EncodingCompact, nil)
	chunk := filepath.Join(a, "chunks", "000000000004-000000000008.arrow")
	good, _ := os.ReadFile(chunk)
	bad := append([]byte(nil), good...)
	bad[len(bad)/2] ^= 1
	os.WriteFile(chunk, bad, 0o644)
	outDir := t.TempDir()
	for _, format := range []string{"jsonl", "parquet"} {
		out := filepath.Join(outDir, "new."+format)
		_, err := run(t, wrap(exportMain), "--cache", a, "--format", format, "--out", out)
		if err == nil || !strings.Contains(err.Error(), "000000000004-000000000008.arrow") || strings.Contains(err.Error(), "--out") {
			t.Fatalf("export --format %s of a damaged cache: %v; want the chunk's error", format, err)
		}
		if _, err := os.Stat(out); !os.IsNotExist(err) {
			t.Errorf("export --format %s that failed left %s (%v)", format, out, err)
		}
		old := filepath.Join(outDir, "old."+format)
		os.WriteFile(old, []byte("previous export"), 0o644)
		run(t, wrap(exportMain), "--cache", a, "--format", format, "--out", old)
		if b, _ := os.ReadFile(old); string(b) != "previous export" {
			t.Errorf("export --format %s that failed changed the existing --out to %q", format, b)
		}
	}
	if ents, _ := os.ReadDir(outDir); len(ents) != 2 {
		t.Errorf("failed exports left files in --out's directory: %v", ents)
	}
	os.WriteFile(chunk, good, 0o644)

	_, err := run(t, wrap(exportMain), "--cache", a, "--out", filepath.Join(outDir, "missing", "x.jsonl"))
	if err == nil || !strings.HasPrefix(err.Error(), "--out: writing ") || !strings.Contains(err.Error(), "cannot create a file in "+filepath.Join(outDir, "missing")) {
		t.Errorf("export --out in a missing directory: %v", err)
	}
	if _, err := run(t, wrap(exportMain), "--cache", a, "--out", outDir); err == nil || !strings.Contains(err.Error(), "--out "+outDir+" is a directory") {
		t.Errorf("export --out DIR: %v", err)
	}
	// A FIFO stands for /dev/null: a rename would replace it with a
	// regular file.
	fifo := filepath.Join(t.TempDir(), "fifo")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	read := make(chan int)
	go func() {
		f, err := os.Open(fifo)
		if err != nil {
			read <- -1
			return
		}
		b, _ := io.ReadAll(f)
		f.Close()
		read <- bytes.Count(b, []byte("\n"))
	}()
	if _, err := run(t, wrap(exportMain), "--cache", a, "--out", fifo); err != nil {
		t.Errorf("export --out FIFO: %v", err)
	}
	if n := <-read; n != 8 {
		t.Errorf("export --out FIFO: the reader got %d lines, want 8", n)
	}
	if fi, err := os.Stat(fifo); err != nil || fi.Mode()&os.ModeNamedPipe == 0 {
		t.Fatalf("export --out FIFO replaced it: %v %v", fi.Mode(), err)
	}
	out := filepath.Join(outDir, "ok.jsonl")
	if _, err := run(t, wrap(exportMain), "--cache", a, "--out", out); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(out); bytes.Count(b, []byte("\n")) != 8 {
		t.Errorf("export --out of [0, 8): %d lines", bytes.Count(b, []byte("\n")))
	}
}

// failWriter fails every write, as a full disk does.
type failWriter struct{}

func (failWriter) Write([]byte) (int, error) { return 0, syscall.ENOSPC }

// TestExportOutputFails: an export whose output cannot be written (a full
// disk) fails with the write's error, in either format. The Parquet
// writer panicked on its first failed write ("failed to write magic
// number"), with a stack trace and exit status 2.
func TestExportOutputFails(t *testing.T) {
	a, _ := makeCtlCaches(t, cache.EncodingCompact, nil)
	for _, format := range []string{"jsonl", "parquet"} {
		var stderr bytes.Buffer
		err := exportMain([]string{"--cache", a, "--format", format}, failWriter{}, &stderr)
		if !errors.Is(err, syscall.ENOSPC) {
			t.Errorf("export --format %s to a full disk: %v; want the write's error", format, err)
		}
	}
}

// TestExportInterrupted: Ctrl-C during an export to --out leaves nothing
// next to --out and exits 130 saying so. The signal killed the process,
// which left its half-written temporary file (--out.<random>.tmp,
// hundreds of MB for a real cache). The signal is stood for by a context
// cancelled as the first SIGINT cancels signalContext's.
func TestExportInterrupted(t *testing.T) {
	a, _ := makeCtlCaches(t, cache.EncodingCompact, nil)
	for _, format := range []string{"jsonl", "parquet"} {
		outDir := t.TempDir()
		out := filepath.Join(outDir, "x."+format)
		ctx, cancel := context.WithCancelCause(context.Background())
		cancel(signalError{syscall.SIGINT})
		err := exportCtx(ctx, []string{"--cache", a, "--format", format, "--out", out}, io.Discard, io.Discard)
		var in *cli.Interrupted
		if !errors.As(err, &in) || cli.ExitStatus(err) != 130 || !strings.Contains(err.Error(), "nothing written to "+out) {
			t.Errorf("export --format %s stopped by SIGINT: %v (exit %d); want exit 130 saying nothing was written", format, err, cli.ExitStatus(err))
		}
		if ents, _ := os.ReadDir(outDir); len(ents) != 0 {
			t.Errorf("export --format %s stopped by SIGINT left %v", format, ents)
		}
		err = exportCtx(ctx, []string{"--cache", a, "--format", format}, io.Discard, io.Discard)
		if cli.ExitStatus(err) != 130 || !strings.Contains(err.Error(), "the output is incomplete") {
			t.Errorf("export --format %s to stdout stopped by SIGINT: %v", format, err)
		}
	}
}

// TestExportFormatFromOut: an --out ending in .parquet is written as
// Parquet when --format is left out (it was written as JSONL, which no
// Parquet reader opens); a --format that contradicts --out's extension
// is a usage error naming both.
func TestExportFormatFromOut(t *testing.T) {
	a, _ := makeCtlCaches(t, cache.EncodingCompact, nil)
	dir := t.TempDir()
	for name, magic := range map[string]string{"x.parquet": "PAR1", "x.PARQUET": "PAR1", "x.jsonl": `{"`, "x.out": `{"`} {
		out := filepath.Join(dir, name)
		if _, err := run(t, wrap(exportMain), "--cache", a, "--out", out); err != nil {
			t.Fatalf("export --out %s: %v", name, err)
		}
		if b, _ := os.ReadFile(out); !bytes.HasPrefix(b, []byte(magic)) {
			t.Errorf("export --out %s without --format wrote %.20q, want a file that starts %q", name, b, magic)
		}
	}
	for _, c := range [][2]string{{"jsonl", "y.parquet"}, {"parquet", "y.jsonl"}} {
		_, err := run(t, wrap(exportMain), "--cache", a, "--format", c[0], "--out", filepath.Join(dir, c[1]))
		if cli.ExitStatus(err) != 2 || !strings.Contains(err.Error(), "--format "+c[0]+" with --out ") || !strings.Contains(err.Error(), "leave out --format") {
			t.Errorf("--format %s --out %s: %v (exit %d), want a usage error naming both", c[0], c[1], err, cli.ExitStatus(err))
		}
	}
}

// TestExportOutInsideCache: an --out that is a cache directory being
// read, or lies inside one (its index/ or chunks/, through a symbolic
// link too), is refused before anything is read or written, naming both
// and a path outside: `--out CACHE/index/MANIFEST` replaced the index's
// manifest with the export, and the cache no longer opened.
func TestExportOutInsideCache(t *testing.T) {
	a, b := makeCtlCaches(t, cache.EncodingCompact, nil)
	before := treeFiles(t, a, b)
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(filepath.Join(b, "chunks"), link); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ out, cache string }{
		{filepath.Join(a, "index", "MANIFEST"), a},
		{filepath.Join(a, "index", "new.jsonl"), a},
		{filepath.Join(a, "chunks", "x.parquet"), a},
		{filepath.Join(a, "x.jsonl"), a},
		{a, a},
		{filepath.Join(b, "index", "MANIFEST"), b},
		{filepath.Join(link, "x.jsonl"), b},
	} {
		_, err := run(t, wrap(exportMain), "--cache", a, "--cache", b, "--out", tc.out)
		format := "jsonl"
		if strings.HasSuffix(tc.out, ".parquet") {
			format = "parquet"
		}
		want := "--out " + tc.out + " is inside --cache " + tc.cache + ", the cache directory being exported"
		if cli.ExitStatus(err) != 2 || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "e.g. --out "+tc.cache+"."+format) {
			t.Errorf("export --out %s: %v (exit %d); want exit 2 with %q and a path outside", tc.out, err, cli.ExitStatus(err), want)
		}
	}
	if after := treeFiles(t, a, b); !maps.Equal(before, after) {
		t.Errorf("refused exports changed the caches: %d files before, %d after", len(before), len(after))
	}
	out := a + ".jsonl" // beside the cache, as the error suggests
	if _, err := run(t, wrap(exportMain), "--cache", a, "--out", out); err != nil {
		t.Fatalf("export --out beside the cache: %v", err)
	}
	if _, err := run(t, wrap(verifyMain), "--cache", a); err != nil {
		t.Errorf("verify after the exports: %v", err)
	}
}

// treeFiles is the content of every file under dirs, by path.
func treeFiles(t *testing.T, dirs ...string) map[string]string {
	t.Helper()
	files := map[string]string{}
	for _, d := range dirs {
		err := filepath.WalkDir(d, func(p string, e os.DirEntry, err error) error {
			if err != nil || e.IsDir() {
				return err
			}
			b, err := os.ReadFile(p)
			files[p] = string(b)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return files
}

package model

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"

	"distill/internal/testdirs"
)

func names(t *testing.T, dir string) string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	sort.Strings(out)
	return strings.Join(out, " ")
}

// TestWriteDir: a new or empty directory is written; a non-empty one is
// refused without force and replaced whole with it (no old file left); a
// failed write leaves the old directory as it was; no temporary sibling
// is left behind.
func TestWriteDir(t *testing.T) {
	parent := t.TempDir()
	dir := filepath.Join(parent, "out")
	put := func(files ...string) func(string) error {
		return func(tmp string) error {
			for _, f := range files {
				if err := os.WriteFile(filepath.Join(tmp, f), []byte(f), 0o644); err != nil {
					return err
				}
			}
			return nil
		}
	}
	if err := WriteDir(dir, false, put("a", "b")); err != nil {
		t.Fatal(err)
	}
	if got := names(t, dir); got != "a b" {
		t.Fatalf("new dir holds %q", got)
	}
	err := WriteDir(dir, false, put("c"))
	if !errors.Is(err, ErrNotEmpty) || !strings.Contains(err.Error(), "is not empty (it holds a, b)") || !strings.Contains(err.Error(), "--force") {
		t.Fatalf("non-empty dir without force: %v", err)
	}
	if err := WriteDir(dir, true, func(tmp string) error {
		put("c")(tmp)
		return errors.New("disk full")
	}); err == nil || !strings.Contains(err.Error(), "disk full") {
		t.Fatalf("failed write: %v", err)
	}
	if got := names(t, dir); got != "a b" {
		t.Fatalf("a failed write changed the old dir: %q", got)
	}
	if err := WriteDir(dir, true, put("c")); err != nil {
		t.Fatal(err)
	}
	if got := names(t, dir); got != "c" {
		t.Fatalf("forced replace holds %q, want only the new file", got)
	}
	if got := names(t, parent); got != "out" {
		t.Fatalf("leftovers beside the output: %q", got)
	}
	empty := filepath.Join(parent, "empty")
	os.Mkdir(empty, 0o755)
	if err := WriteDir(empty, false, put("x")); err != nil {
		t.Fatalf("an empty existing dir: %v", err)
	}
	file := filepath.Join(parent, "file")
	os.WriteFile(file, nil, 0o644)
	if err := WriteDir(file, true, put("x")); err == nil || !strings.Contains(err.Error(), "not a directory") {
		t.Fatalf("a file as the output: %v", err)
	}
}

// TestWriteDirUnwritable: an output WriteDir cannot write is refused
// before write runs, naming the output and the directory or file at
// fault, not the temporary directory beside it ("mkdir
// /ro/.tmp-out-123: read-only file system") or only "stat
// file/out: not a directory"), and without the package's "model: ".
func TestWriteDirUnwritable(t *testing.T) {
	ro := testdirs.Unwritable(t)
	file := filepath.Join(t.TempDir(), "file")
	os.WriteFile(file, nil, 0o644)
	for _, c := range []struct{ dir, want string }{
		{filepath.Join(ro, "out"), "cannot write " + filepath.Join(ro, "out") + ": cannot create files in " + ro + " ("},
		{filepath.Join(ro, "a", "b", "out"), "cannot create files in " + ro + " ("},
		{filepath.Join(file, "out"), "cannot write " + filepath.Join(file, "out") + ": " + file + " is a file, not a directory"},
		{filepath.Join(file, "a", "out"), ": " + file + " is a file, not a directory"},
	} {
		ran := false
		err := WriteDir(c.dir, false, func(string) error { ran = true; return nil })
		if err == nil || !strings.Contains(err.Error(), c.want) || strings.HasPrefix(err.Error(), "model:") || strings.Contains(err.Error(), ".tmp-") || ran {
			t.Errorf("%s: %v (write ran: %v), want %q", c.dir, err, ran, c.want)
		}
	}
}

// TestCheckpointTorchDType: config.json's torch_dtype is the weights'
// dtype; an F32 checkpoint (student export --format f32) said bfloat16,
// so that transformers' torch_dtype="auto" rounded the exact weights.
func TestCheckpointTorchDType(t *testing.T) {
	cfg, err := Preset(ArchQwen3)
	if err != nil {
		t.Fatal(err)
	}
	w := Init(cfg, InitOptions{Seed: 1})
	for dtype, want := range map[string]string{"BF16": "bfloat16", "F32": "float32"} {
		dir := filepath.Join(t.TempDir(), dtype)
		if err := WriteCheckpoint(dir, cfg, w, dtype); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(filepath.Join(dir, "config.json"))
		if err != nil {
			t.Fatal(err)
		}
		var m map[string]any
		if err := json.Unmarshal(b, &m); err != nil {
			t.Fatal(err)
		}
		if m["torch_dtype"] != want {
			t.Errorf("%s checkpoint: torch_dtype %v, want %s", dtype, m["torch_dtype"], want)
		}
		if _, err := LoadConfig(dir); err != nil {
			t.Errorf("%s checkpoint's config.json does not load: %v", dtype, err)
		}
	}
}

// TestWriteDirMountPoint: an existing directory that is a mount point
// cannot be replaced (rename and rmdir of a mount point fail, EBUSY), so
// WriteDir and CheckOut refuse it before anything is written, saying to
// write inside it: WriteDir wrote the whole model beside it, on the file
// system the mount hides, and failed only then. A mount point is one
// mountinfo lists (a bind mount on the same file system; here a fake
// file) or a directory on another device than its parent (/proc).
func TestWriteDirMountPoint(t *testing.T) {
	parent := t.TempDir()
	empty := filepath.Join(parent, "mnt disk") // mountinfo escapes the space
	full := filepath.Join(parent, "full")
	os.Mkdir(empty, 0o755)
	os.Mkdir(full, 0o755)
	os.WriteFile(filepath.Join(full, "a"), nil, 0o644)
	info := filepath.Join(t.TempDir(), "mountinfo")
	esc := func(p string) string { return strings.ReplaceAll(p, " ", `\040`) }
	os.WriteFile(info, []byte("22 1 0:21 / /proc rw - proc proc rw\n"+
		"40 22 8:1 /data "+esc(empty)+" rw,relatime - ext4 /dev/sda1 rw\n"+
		"41 22 8:1 /data2 "+esc(full)+" rw,relatime - ext4 /dev/sda1 rw\n"), 0o644)
	old := mountInfo
	mountInfo = info
	t.Cleanup(func() { mountInfo = old })
	for _, c := range []struct {
		dir   string
		force bool
	}{{empty, false}, {full, true}, {empty + "/", false}} {
		want := filepath.Clean(c.dir) + " is a mount point, and the new directory is written beside it and renamed into its place, which a mount point refuses: choose a directory inside it, e.g. " + filepath.Join(c.dir, "model")
		ran := false
		err := WriteDir(c.dir, c.force, func(string) error { ran = true; return nil })
		if !errors.Is(err, ErrNotReplaceable) || !strings.Contains(err.Error(), want) || ran {
			t.Errorf("WriteDir(%s, force %v): %v (write ran: %v), want ErrNotReplaceable saying %q", c.dir, c.force, err, ran, want)
		}
		if err := CheckOut(c.dir, c.force); !errors.Is(err, ErrNotReplaceable) || !strings.Contains(err.Error(), want) {
			t.Errorf("CheckOut(%s, force %v): %v", c.dir, c.force, err)
		}
	}
	if got := names(t, parent); got != "full mnt disk" {
		t.Errorf("a refused write left %q beside the mount points", got)
	}
	if got := names(t, full); got != "a" {
		t.Errorf("a refused forced write changed the mount point: %q", got)
	}
	// Within it, or a directory beside it, is written.
	if err := WriteDir(filepath.Join(empty, "model"), false, func(string) error { return nil }); err != nil {
		t.Errorf("a directory inside the mount point: %v", err)
	}
	if err := CheckOut(filepath.Join(parent, "other"), false); err != nil {
		t.Errorf("a directory beside the mount point: %v", err)
	}
	// A real mount point, found by its device.
	mountInfo = filepath.Join(t.TempDir(), "none")
	if a, err := os.Stat("/proc"); err == nil {
		if b, err := os.Stat("/"); err == nil && a.Sys().(*syscall.Stat_t).Dev != b.Sys().(*syscall.Stat_t).Dev {
			if err := CheckOut("/proc", true); !errors.Is(err, ErrNotReplaceable) {
				t.Errorf("CheckOut(/proc, force): %v, want ErrNotReplaceable", err)
			}
		}
	}
}

// TestCheckOutUnwritable: CheckOut refuses, as WriteDir does, an output
// nothing can be written beside, naming it and the directory at fault;
// it makes nothing.
func TestCheckOutUnwritable(t *testing.T) {
	ro := testdirs.Unwritable(t)
	file := filepath.Join(t.TempDir(), "file")
	os.WriteFile(file, nil, 0o644)
	for _, c := range []struct{ dir, want string }{
		{filepath.Join(ro, "out"), "cannot write " + filepath.Join(ro, "out") + ": cannot create files in " + ro + " ("},
		{filepath.Join(ro, "a", "b", "out"), "cannot create files in " + ro + " ("},
		{filepath.Join(file, "out"), "cannot write " + filepath.Join(file, "out") + ": " + file + " is a file, not a directory"},
		{filepath.Join(file, "a", "out"), ": " + file + " is a file, not a directory"},
		{file, file + " exists and is not a directory"},
	} {
		if err := CheckOut(c.dir, false); err == nil || !strings.Contains(err.Error(), c.want) || strings.HasPrefix(err.Error(), "model:") || strings.Contains(err.Error(), ".probe-") {
			t.Errorf("%s: %v, want %q", c.dir, err, c.want)
		}
	}
}

// TestWriteDirForceKeepsData: force replaces a model directory, not a
// teacher cache, a training run or a dataset directory given as the
// output by mistake: `student export --out CACHE --force` removed the
// cache and exited 0. Each is refused before write runs, with nothing
// removed, naming what the directory is.
func TestWriteDirForceKeepsData(t *testing.T) {
	parent := t.TempDir()
	mk := func(name string, paths ...string) string {
		dir := filepath.Join(parent, name)
		for _, p := range paths {
			full := filepath.Join(dir, p)
			if strings.HasSuffix(p, "/") {
				os.MkdirAll(full, 0o755)
				continue
			}
			os.MkdirAll(filepath.Dir(full), 0o755)
			os.WriteFile(full, []byte("x"), 0o644)
		}
		return dir
	}
	for _, c := range []struct {
		dir, want string
	}{
		{mk("cache", "LOCK", "index/MANIFEST", "chunks/000000000000-000000000040.arrow", "tmp/"), "is a teacher cache (index/ and chunks/, as cachectl fill writes them)"},
		{mk("run", "config.yaml", "metrics.jsonl", "checkpoints/step-00000006/model.safetensors"), "is a student train run directory (checkpoints/)"},
		{mk("hub", "config.json", "model.safetensors", "original/consolidated.pth"), "holds directories (original/), which no model written by student init or export holds"},
		{mk("data", "train.jsonl", "stats.json", "held.parquet"), "holds dataset files (held.parquet, train.jsonl)"},
	} {
		before := names(t, c.dir)
		ran := false
		err := WriteDir(c.dir, true, func(string) error { ran = true; return nil })
		want := c.dir + " " + c.want + ": only a model directory is replaced (--force), and this one's data would be lost; nothing was removed: choose a new directory, e.g. " + c.dir + "-model"
		if !errors.Is(err, ErrNotReplaceable) || err.Error() != want || ran {
			t.Errorf("WriteDir(%s, force): %v (write ran: %v)\nwant %s", c.dir, err, ran, want)
		}
		for _, force := range []bool{true, false} {
			// Without force too: its advice was "give --force".
			if err := CheckOut(c.dir, force); !errors.Is(err, ErrNotReplaceable) || strings.Contains(err.Error(), "give --force") {
				t.Errorf("CheckOut(%s, force %v): %v, want ErrNotReplaceable", c.dir, force, err)
			}
		}
		if got := names(t, c.dir); got != before {
			t.Errorf("a refused forced write changed %s: %q, was %q", c.dir, got, before)
		}
	}
	// An earlier model, a stray file beside it, is still replaced.
	model := mk("model", "config.json", "model.safetensors", "generation_config.json", "notes.txt")
	if err := WriteDir(model, true, func(tmp string) error { return os.WriteFile(filepath.Join(tmp, "config.json"), nil, 0o644) }); err != nil {
		t.Fatalf("forced replace of a model directory: %v", err)
	}
	if got := names(t, model); got != "config.json" {
		t.Errorf("forced replace holds %q, want config.json", got)
	}
}

// TestWriteDirInterrupted: SIGINT or SIGTERM while WriteDir writes (an
// export or init stopped with Ctrl-C, or by a scheduler) left the hidden
// .tmp-OUT-PID beside the output, as large as the model, and no later
// run removed it. Now the process still ends by the signal, and leaves
// nothing beside the output; a forced replace leaves the old directory
// as it was. The writer is a child process (this test binary) that
// says when it is writing, then waits, or writes on until its directory
// is gone and returns that error: the process must still end by the
// signal, not exit 1. No timing is involved.
func TestWriteDirInterrupted(t *testing.T) {
	for _, c := range []struct {
		sig         syscall.Signal
		force, wait bool
	}{{syscall.SIGINT, false, true}, {syscall.SIGTERM, false, true}, {syscall.SIGINT, true, true}, {syscall.SIGTERM, false, false}, {syscall.SIGINT, true, false}} {
		parent := t.TempDir()
		out := filepath.Join(parent, "out")
		if c.force {
			os.Mkdir(out, 0o755)
			os.WriteFile(filepath.Join(out, "config.json"), []byte("old"), 0o644)
		}
		cmd := exec.Command(os.Args[0], "-test.run=^TestWriteDirInterruptedHelper$")
		cmd.Env = append(os.Environ(), "WRITEDIR_HELPER_OUT="+out, fmt.Sprintf("WRITEDIR_HELPER_FORCE=%v", c.force), fmt.Sprintf("WRITEDIR_HELPER_WAIT=%v", c.wait))
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		stdin, err := cmd.StdinPipe() // never written: the helper waits on it
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(stdout)
		for sc.Scan() && sc.Text() != "writing" {
		}
		cmd.Process.Signal(c.sig)
		for sc.Scan() {
		}
		cmd.Wait()
		stdin.Close()
		ws, _ := cmd.ProcessState.Sys().(syscall.WaitStatus)
		if !ws.Signaled() || ws.Signal() != c.sig {
			t.Errorf("%v (wait %v): the writer ended with %v, want killed by the signal", c.sig, c.wait, cmd.ProcessState)
		}
		want := ""
		if c.force {
			want = "out"
			if b, _ := os.ReadFile(filepath.Join(out, "config.json")); string(b) != "old" {
				t.Errorf("%v during a forced replace: the old directory holds %q", c.sig, b)
			}
		}
		if got := names(t, parent); got != want {
			t.Errorf("%v (force %v): %q beside the output, want %q", c.sig, c.force, got, want)
		}
	}
}

// TestWriteDirInterruptedHelper is TestWriteDirInterrupted's child.
func TestWriteDirInterruptedHelper(t *testing.T) {
	out := os.Getenv("WRITEDIR_HELPER_OUT")
	if out == "" {
		t.Skip("the child of TestWriteDirInterrupted")
	}
	err := WriteDir(out, os.Getenv("WRITEDIR_HELPER_FORCE") == "true", func(tmp string) error {
		if err := os.WriteFile(filepath.Join(tmp, "model.safetensors"), make([]byte, 1<<20), 0o644); err != nil {
			return err
		}
		fmt.Println("writing")
		if os.Getenv("WRITEDIR_HELPER_WAIT") == "true" {
			io.ReadAll(os.Stdin) // until the signal ends the process
			return errors.New("not interrupted")
		}
		// As an export does: write on until the directory is gone, and
		// return that error (WriteDir must not return it and exit 1).
		for i := 0; ; i++ {
			if err := os.WriteFile(filepath.Join(tmp, fmt.Sprintf("f%d", i%64)), make([]byte, 1<<16), 0o644); err != nil {
				return err
			}
		}
	})
	t.Fatalf("WriteDir returned: %v", err)
}

package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"distill/compute/cuda/cudaemu"
)

// runTeacherd runs `teacherd ARGS --listen 127.0.0.1:0 --metrics off`
// (this test binary) to its end, without CUDA_VISIBLE_DEVICES, and
// returns its stderr and exit status.
func runTeacherd(t *testing.T, args ...string) (string, int) {
	t.Helper()
	cmd := exec.Command(os.Args[0], append(args, "--listen", "127.0.0.1:0", "--metrics", "off")...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "CUDA_VISIBLE_DEVICES=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "TEACHERD_TEST_MAIN=1")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	err := cmd.Run()
	if _, ok := err.(*exec.ExitError); err != nil && !ok {
		t.Fatal(err)
	}
	return stderr.String(), cmd.ProcessState.ExitCode()
}

// lastLine is s's last line.
func lastLine(s string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return lines[len(lines)-1]
}

// TestStartupErrorsOneSentence: teacherd's startup errors read as one
// sentence naming the flag and the fix, without the package prefixes
// each layer wrapped them in: a --devices GPU that does not exist said
// "teacherd: serve: bad configuration: device: unavailable: --devices:
// GPU 1: cuda: device 1 does not exist: the driver sees 1 GPU(s),
// ordinals 0..0".
func TestStartupErrorsOneSentence(t *testing.T) {
	cudaemu.Use(t)
	if cudaemu.OnGPU() {
		t.Skip("the GPUs a machine has are its own")
	}
	t.Setenv("DISTILL_EMU_DEVICES", "1")
	t.Setenv("DISTILL_KERNEL_CACHE", t.TempDir())
	m := tinyModelDir(t)
	missing := filepath.Join(t.TempDir(), "nosuchmodel")
	for _, tc := range []struct {
		args []string
		want string // the whole line
	}{
		{[]string{"--model", m, "--device", "cuda", "--devices", "0,1"},
			"teacherd: --devices 0,1: GPU 1 does not exist (this machine has 1 GPU: 0): name only those, or --devices all"},
		{[]string{"--model", m, "--devices", "0,x"},
			`teacherd: --devices "0,x": want GPU ordinals separated by commas (0,1,2,3) or all`},
		{[]string{"--model", m, "--device", "gpu"}, `teacherd: --device "gpu": want auto, cpu or cuda`},
		{[]string{"--model", m, "--weights", "fp4"}, `teacherd: --weights "fp4": want bf16 or fp8`},
		{[]string{"--model", missing}, "teacherd: --model " + missing + ": open " + filepath.Join(missing, "config.json") +
			": no such file or directory (a checkpoint directory needs config.json)"},
	} {
		stderr, code := runTeacherd(t, tc.args...)
		if got := lastLine(stderr); code != 1 || got != tc.want {
			t.Errorf("teacherd %s: exit %d, last line\n%s\nwant exit 1 and\n%s", strings.Join(tc.args, " "), code, got, tc.want)
		}
	}
	// Without a driver: the driver's own fix, then the CPU's.
	t.Setenv("DISTILL_LIBCUDA", filepath.Join(t.TempDir(), "libcuda.so.1"))
	for _, tc := range []struct {
		args         []string
		prefix, tail string
	}{
		{[]string{"--model", m, "--device", "cuda"}, "teacherd: --device cuda: cannot load the CUDA driver: ", "; without a GPU, use --device cpu"},
		{[]string{"--model", m, "--device", "cuda", "--devices", "0"}, "teacherd: --devices 0: GPU 0 does not open: cannot load the CUDA driver: ",
			"; without GPUs, leave --devices out and use --device cpu"},
	} {
		stderr, code := runTeacherd(t, tc.args...)
		got := lastLine(stderr)
		if code != 1 || !strings.HasPrefix(got, tc.prefix) || !strings.HasSuffix(got, tc.tail) || !strings.Contains(got, "DISTILL_LIBCUDA") {
			t.Errorf("teacherd %s without a driver: exit %d, last line\n%s\nwant exit 1, %q ... %q", strings.Join(tc.args, " "), code, got, tc.prefix, tc.tail)
		}
		for _, prefix := range []string{": serve: ", ": device: ", ": cuda: "} {
			if strings.Contains(got, prefix) {
				t.Errorf("teacherd %s: a package prefix %q in %s", strings.Join(tc.args, " "), prefix, got)
			}
		}
	}
}

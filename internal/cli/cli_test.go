package cli

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
)

// testRegistry's "run" fails as a command does: a usage error for a bad
// flag or an argument, a runtime error for --fail, an interrupted job
// for --interrupt.
func testRegistry() *Registry {
	r := New("prog")
	r.Register(&Command{Name: "run", Summary: "run something", Run: func(args []string) error {
		fs := flag.NewFlagSet("prog run", flag.ContinueOnError)
		fs.SetOutput(&bytes.Buffer{})
		fs.Int("n", 0, "a number")
		fail := fs.Bool("fail", false, "fail at run time")
		interrupt := fs.Bool("interrupt", false, "be stopped by SIGINT")
		if err := ParseFlags(fs, args); err != nil {
			return err
		}
		switch {
		case fs.NArg() > 0:
			return Usagef("unexpected arguments %q", fs.Args())
		case *fail:
			return errors.New("boom")
		case *interrupt:
			return &Interrupted{Signal: syscall.SIGINT, Msg: "stopped by SIGINT"}
		}
		return nil
	}})
	return r
}

// TestHelpExitsZero: asking for help is a success (exit 0, usage on
// stdout); no command or an unknown one is a usage error (2, usage on
// stderr), and so is a command's bad flag or argument (2, the error
// naming the command once); a command failing at run time is 1.
func TestHelpExitsZero(t *testing.T) {
	for _, tc := range []struct {
		args      []string
		code      int
		stdoutHas string
		stderrHas string
	}{
		{[]string{"--help"}, 0, "usage: prog COMMAND", ""},
		{[]string{"-h"}, 0, "usage: prog COMMAND", ""},
		{[]string{"-help"}, 0, "run something", ""},
		{[]string{"help"}, 0, "run something", ""},
		{[]string{"help", "run"}, 0, "", ""},
		{[]string{"run", "-h"}, 0, "", ""},
		{[]string{"run", "--help"}, 0, "", ""},
		{[]string{"run"}, 0, "", ""},
		{nil, 2, "", "usage: prog COMMAND"},
		{[]string{"nope"}, 2, "", `unknown command "nope"` + "\n"},
		{[]string{"rnu"}, 2, "", `unknown command "rnu": did you mean "run"?`},
		{[]string{"run", "extra"}, 2, "", `prog run: unexpected arguments ["extra"]` + "\n"},
		{[]string{"run", "-bad"}, 2, "", "prog run: flag provided but not defined: -bad\n"},
		{[]string{"run", "-fial"}, 2, "", "prog run: flag provided but not defined: -fial (did you mean --fail?)\n"},
		{[]string{"run", "-n", "x"}, 2, "", `prog run: invalid value "x" for flag -n`},
		{[]string{"run", "-fail"}, 1, "", "prog run: boom\n"},
		{[]string{"run", "-interrupt"}, 130, "", "prog run: stopped by SIGINT\n"},
	} {
		var out, errb bytes.Buffer
		code := testRegistry().Run(tc.args, &out, &errb)
		if code != tc.code || !strings.Contains(out.String(), tc.stdoutHas) || !strings.Contains(errb.String(), tc.stderrHas) {
			t.Errorf("%q: exit %d, want %d\nstdout: %s\nstderr: %s", tc.args, code, tc.code, out.String(), errb.String())
		}
		if strings.Count(errb.String(), "prog run:") > 1 {
			t.Errorf("%q: stderr names the command twice: %s", tc.args, errb.String())
		}
	}
}

// TestExitStatus: the exit status of each kind of error, wrapped or not.
func TestExitStatus(t *testing.T) {
	usage := Usagef("--cache is required")
	for _, tc := range []struct {
		err  error
		want int
	}{
		{nil, 0},
		{flag.ErrHelp, 0},
		{errors.New("open x: no such file or directory"), 1},
		{usage, 2},
		{fmt.Errorf("context: %w", usage), 2},
		{Usage(fmt.Errorf("--data: %w", os.ErrNotExist)), 2},
		{&Interrupted{Signal: syscall.SIGTERM, Msg: "stopped"}, 143},
		{&Interrupted{Signal: syscall.SIGINT, Msg: "stopped"}, 130},
		{&Interrupted{Signal: syscall.SIGTERM, Msg: "stopped", Exit0: true}, 0},
		{fmt.Errorf("run: %w", &Interrupted{Signal: syscall.SIGTERM, Msg: "stopped", Exit0: true}), 0},
	} {
		if got := ExitStatus(tc.err); got != tc.want {
			t.Errorf("ExitStatus(%v) = %d, want %d", tc.err, got, tc.want)
		}
	}
	// A usage error says what it wraps, and no more.
	inner := fmt.Errorf("--weights %q: %w", "x", os.ErrInvalid)
	if err := Usage(inner); err.Error() != inner.Error() || !errors.Is(err, os.ErrInvalid) {
		t.Errorf("Usage(%v) = %v, unwrapping to %v", inner, err, errors.Unwrap(err))
	}
	if Usage(nil) != nil {
		t.Error("Usage(nil) is not nil")
	}
}

// TestMain runs Main (which exits) when re-executed by TestMainExitCodes.
func TestMain(m *testing.M) {
	if args, ok := os.LookupEnv("CLI_TEST_MAIN_ARGS"); ok {
		testRegistry().Main(strings.Fields(args))
	}
	os.Exit(m.Run())
}

// TestMainExitCodes runs Main in a child process, as a user runs
// `student --help`: help exits 0 with the usage on stdout; usage errors
// (no or an unknown command, an unknown flag, a bad flag value, an extra
// argument) exit 2; a runtime failure 1; an interrupted job 128+signal.
func TestMainExitCodes(t *testing.T) {
	for _, tc := range []struct {
		args string
		code int
	}{{"--help", 0}, {"-h", 0}, {"run -h", 0}, {"run", 0}, {"", 2}, {"nope", 2}, {"run extra", 2}, {"run -bad", 2},
		{"run -n x", 2}, {"run -fail", 1}, {"run -interrupt", 130}} {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "CLI_TEST_MAIN_ARGS="+tc.args)
		var out bytes.Buffer
		cmd.Stdout = &out
		err := cmd.Run()
		code := 0
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		if code != tc.code {
			t.Errorf("prog %s: exit %d, want %d", tc.args, code, tc.code)
		}
		if tc.args == "--help" && !strings.Contains(out.String(), "usage: prog COMMAND") {
			t.Errorf("prog --help: stdout %q lacks the usage", out.String())
		}
	}
}

// TestParseFlags: an undefined flag's error names the defined flag it
// most likely meant, if one is near; -h is flag.ErrHelp as before; good
// flags parse.
func TestParseFlags(t *testing.T) {
	mk := func() (*flag.FlagSet, *string) {
		fs := flag.NewFlagSet("x", flag.ContinueOnError)
		fs.SetOutput(&bytes.Buffer{})
		c := fs.String("cache", "", "")
		fs.Int("max-len", 0, "")
		return fs, c
	}
	for _, tc := range []struct {
		args []string
		want string // in the error; "" no error
	}{
		{[]string{"--cahce", "d"}, "flag provided but not defined: -cahce (did you mean --cache?)"},
		{[]string{"-max_len=3"}, "(did you mean --max-len?)"},
		{[]string{"--zzzzzz"}, "flag provided but not defined: -zzzzzz"},
		{[]string{"--cache", "d"}, ""},
	} {
		fs, c := mk()
		err := ParseFlags(fs, tc.args)
		var ue *UsageError
		if err != nil && !errors.As(err, &ue) {
			t.Errorf("%v: %v is not a *UsageError (exit 2)", tc.args, err)
		}
		switch {
		case tc.want == "" && (err != nil || *c != "d"):
			t.Errorf("%v: %v, cache %q", tc.args, err, *c)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%v: %v, want %q", tc.args, err, tc.want)
		case strings.Contains(tc.args[0], "zzz") && strings.Contains(err.Error(), "did you mean"):
			t.Errorf("%v: %v suggests a flag that is not near", tc.args, err)
		}
	}
	// The flag set prints its usage, but not the error (the command prints
	// it, named): it was said twice.
	fs, _ := mk()
	var out bytes.Buffer
	fs.SetOutput(&out)
	if err := ParseFlags(fs, []string{"--cahce", "d"}); err == nil || strings.Contains(out.String(), "not defined") || !strings.Contains(out.String(), "-max-len int") {
		t.Errorf("--cahce: %v, the flag set printed %q: want its usage alone", err, out.String())
	}
	out.Reset()
	if err := ParseFlags(fs, []string{"--max-len", "x"}); err == nil || strings.Contains(out.String(), "invalid value") || !strings.Contains(out.String(), "-max-len int") {
		t.Errorf("--max-len x: %v, the flag set printed %q: want its usage alone", err, out.String())
	}
	out.Reset()
	if err := ParseFlags(fs, []string{"-h"}); err != flag.ErrHelp || !strings.Contains(out.String(), "-max-len int") {
		t.Errorf("-h: %v, printed %q: want flag.ErrHelp and the usage", err, out.String())
	}
	if fs.Output() != &out {
		t.Errorf("ParseFlags changed the flag set's output")
	}
	fs, _ = mk()
	if err := ParseFlags(fs, []string{"-h"}); err != flag.ErrHelp {
		t.Errorf("-h: %v, want flag.ErrHelp itself", err)
	}
	fs, _ = mk()
	if err := ParseFlags(fs, []string{"--max-len", "x"}); ExitStatus(err) != 2 || !strings.Contains(err.Error(), `invalid value "x" for flag -max-len`) {
		t.Errorf("--max-len x: %v, exit %d, want a usage error (2)", err, ExitStatus(err))
	}
}

// TestParseBytes: the units, and a number without one under 1 MiB is
// refused as a forgotten unit (--device-memory 80 planned for an 80-byte
// device and exited 0).
func TestParseBytes(t *testing.T) {
	for _, c := range []struct {
		s    string
		want int64
	}{{"80GiB", 80 << 30}, {"80GB", 80e9}, {"80 GiB", 80 << 30}, {"0.5GiB", 1 << 29}, {"85899345920", 80 << 30}, {"1MiB", 1 << 20}, {"1048576", 1 << 20}} {
		if got, err := ParseBytes(c.s); err != nil || got != c.want {
			t.Errorf("%q: %d, %v; want %d", c.s, got, err, c.want)
		}
	}
	for _, c := range []struct{ s, want string }{
		{"80", `"80": a size without a unit is bytes, and 80 bytes is no device's memory: did you mean 80GiB?`},
		{"141", "did you mean 141GiB?"},
		{"0", "want a positive size"},
		{"-1", "want a positive size"},
		{"garbage", "want a positive size such as 80GiB, 141GiB or 85899345920 (units: B, KiB, MiB, GiB, TiB, or KB, MB, GB, TB)"},
		{"80gb", "(units: B, KiB"},
		// A unit in the wrong case, or a single letter as Slurm and
		// Docker write sizes: the refusal says which unit was meant.
		{"80gb", "TB): did you mean 80GB? (units are case-sensitive)"},
		{"80gib", "did you mean 80GiB? (units are case-sensitive)"},
		{"80G", "TB): did you mean 80GiB (or 80GB)?"},
		{"1.5t", "did you mean 1.5TiB (or 1.5TB)?"},
		{"80 m", "did you mean 80MiB (or 80MB)?"},
		{"80GiBs", "TB)"},
		{"80gB", "did you mean 80GB? (units are case-sensitive)"},
	} {
		if _, err := ParseBytes(c.s); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: %v, want %q", c.s, err, c.want)
		}
	}
}

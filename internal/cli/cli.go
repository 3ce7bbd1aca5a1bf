// Package cli is the subcommand registry shared by the project's commands
// (cachectl, student): each subcommand registers itself from its own file,
// and main dispatches on os.Args[1].
package cli

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
	"strings"
	"syscall"

	"distill/internal/suggest"
)

// Command is one `PROG NAME` subcommand.
type Command struct {
	Name    string
	Summary string
	Run     func(args []string) error
}

// Registry holds a program's subcommands.
type Registry struct {
	prog     string
	commands map[string]*Command
	// SignalStatuses, when set, replaces "130 for Ctrl-C, 143 for
	// SIGTERM" in the usage's exit statuses: student train exits
	// train.sigterm_exit_status after SIGTERM, 0 by default.
	SignalStatuses string
}

// New returns an empty registry for program prog.
func New(prog string) *Registry { return &Registry{prog: prog, commands: map[string]*Command{}} }

// Register adds c; a duplicate name is a programming error.
func (r *Registry) Register(c *Command) {
	if _, dup := r.commands[c.Name]; dup {
		panic(r.prog + ": command registered twice: " + c.Name)
	}
	r.commands[c.Name] = c
}

func (r *Registry) usage(w io.Writer) {
	fmt.Fprintf(w, "usage: %s COMMAND [flags]\n\ncommands:\n", r.prog)
	names := make([]string, 0, len(r.commands))
	for n := range r.commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %-10s %s\n", n, r.commands[n].Summary)
	}
	fmt.Fprintf(w, "\nRun '%s COMMAND -h' for a command's flags.\n", r.prog)
	signals := r.SignalStatuses
	if signals == "" {
		signals = "130 for Ctrl-C, 143 for SIGTERM"
	}
	fmt.Fprintf(w, exitStatuses, signals)
}

// exitStatuses documents ExitStatus in the programs' usage; %s is the
// registry's SignalStatuses.
const exitStatuses = `
Exit status: 0 on success (and for -h); 1 when the command fails (a file
that does not exist, a bad config, a failed fill); 2 for a usage error (an
unknown command or flag, a bad flag value, a missing required flag,
unexpected arguments); 128+N when signal N stopped a resumable job after
it saved its progress (%s).
`

// Main dispatches args (os.Args[1:]) and exits with Run's status.
func (r *Registry) Main(args []string) { os.Exit(r.Run(args, os.Stdout, os.Stderr)) }

// Run dispatches args and returns the exit status: 0 on success and when
// help was asked for (-h, --help, help: the usage goes to stdout), 2 on
// usage errors (no or an unknown command, the usage going to stderr; or a
// command's *UsageError: an unknown or misspelled flag, a bad flag value,
// a missing required flag, wrong positional arguments), 1 when the
// command fails otherwise (a runtime failure: a missing file, a bad
// config, a failed fill), 128+N when a resumable command was stopped by
// signal N after saving its progress (an *Interrupted error: 130 for
// Ctrl-C, 143 for SIGTERM). A command's error is printed to stderr with
// the program and command name. ExitStatus maps an error to its status.
func (r *Registry) Run(args []string, stdout, stderr io.Writer) int {
	if len(args) < 1 {
		r.usage(stderr)
		return 2
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		if len(args) > 1 && r.commands[args[1]] != nil {
			// "help CMD" is "CMD -h".
			return r.Run([]string{args[1], "-h"}, stdout, stderr)
		}
		r.usage(stdout)
		return 0
	}
	c, ok := r.commands[args[0]]
	if !ok {
		names := make([]string, 0, len(r.commands))
		for n := range r.commands {
			names = append(names, n)
		}
		sort.Strings(names)
		if s := suggest.Closest(args[0], names); s != "" {
			fmt.Fprintf(stderr, "%s: unknown command %q: did you mean %q?\n\n", r.prog, args[0], s)
		} else {
			fmt.Fprintf(stderr, "%s: unknown command %q\n", r.prog, args[0])
		}
		r.usage(stderr)
		return 2
	}
	err := c.Run(args[1:])
	if err != nil && !errors.Is(err, flag.ErrHelp) { // for help, the flag set printed the command's flags
		fmt.Fprintf(stderr, "%s %s: %v\n", r.prog, c.Name, err)
	}
	return ExitStatus(err)
}

// ExitStatus is the exit status of a command that returned err, the
// convention of every command (Registry.Run's, and teacherd's, which has
// no subcommands): 0 for nil and flag.ErrHelp (help asked for is a
// success), 128+N for an *Interrupted stopped by signal N (0 when it
// says Exit0), 2 for a
// *UsageError (as Go's flag.ExitOnError, GNU tools and git exit: the
// command line is wrong, and running it again unchanged fails again), 1
// for any other error.
func ExitStatus(err error) int {
	var in *Interrupted
	var ue *UsageError
	switch {
	case err == nil || errors.Is(err, flag.ErrHelp):
		return 0
	case errors.As(err, &in) && in.Exit0:
		return 0
	case errors.As(err, &in):
		return 128 + int(in.Signal)
	case errors.As(err, &ue):
		return 2
	}
	return 1
}

// UsageError is a command-line usage error: an unknown or misspelled
// flag, a bad flag value, a missing required flag, flags that exclude or
// need each other, wrong positional arguments; what the command line
// alone gets wrong. A command exits 2 for it (ExitStatus), so that a
// script tells a mistyped invocation from a failure of the work itself
// (a file that does not exist, a bad config, a failed fill: 1). Its
// message is Err's: the command name is added once, by Run.
type UsageError struct{ Err error }

func (e *UsageError) Error() string { return e.Err.Error() }
func (e *UsageError) Unwrap() error { return e.Err }

// Usage marks err as a usage error (nil stays nil); errors.Is and
// errors.As still see what err wraps.
func Usage(err error) error {
	if err == nil {
		return nil
	}
	return &UsageError{Err: err}
}

// Usagef is Usage(fmt.Errorf(format, a...)).
func Usagef(format string, a ...any) error { return Usage(fmt.Errorf(format, a...)) }

// ParseFlags parses args into fs (a flag.ContinueOnError set): fs.Parse,
// with an undefined flag's error naming the defined flag it most likely
// meant ("flag provided but not defined: -cahce (did you mean --cache?)").
// Its errors are *UsageErrors (exit 2), but for -h and --help, which are
// flag.ErrHelp itself, unwrapped (exit 0).
//
// The flag set still prints its usage on an error, but not the error: the
// command prints that, named ("cachectl fill: flag provided but not
// defined: -cahce (did you mean --cache?)"), and the flag package's own
// line said it a first time, unnamed and without the suggestion.
func ParseFlags(fs *flag.FlagSet, args []string) error {
	out := fs.Output()
	var buf bytes.Buffer
	fs.SetOutput(&buf)
	err := fs.Parse(args)
	fs.SetOutput(out)
	printed := buf.Bytes()
	if err != nil && err != flag.ErrHelp {
		// The flag package prints err's text and a newline, then the usage.
		printed = bytes.TrimPrefix(printed, []byte(err.Error()+"\n"))
	}
	out.Write(printed)
	if err == nil || err == flag.ErrHelp {
		return err
	}
	name, ok := strings.CutPrefix(err.Error(), "flag provided but not defined: -")
	if !ok {
		return Usage(err)
	}
	var names []string
	fs.VisitAll(func(f *flag.Flag) { names = append(names, f.Name) })
	if s := suggest.Closest(strings.TrimLeft(name, "-"), names); s != "" {
		return Usagef("%w (did you mean --%s?)", err, s)
	}
	return Usage(err)
}

// Interrupted is the error of a resumable job (student train, cachectl
// fill) that a signal stopped after it saved its progress. The one
// convention for all of them: Msg says what was saved and how to resume
// (re-running the same command does), and the exit status is the
// shell's for a job a signal ended, 128+Signal (130 for Ctrl-C, 143 for
// SIGTERM), so that a script or a scheduler (Slurm treats 0 as success)
// knows that the job did not finish. Exit0 makes the status 0 instead:
// student train's train.sigterm_exit_status for a preempted job, which
// the scheduler requeues itself (Slurm), asks for it.
type Interrupted struct {
	Signal syscall.Signal
	Msg    string
	Exit0  bool
}

func (e *Interrupted) Error() string { return e.Msg }

// SignalName is "SIGINT" for syscall.SIGINT, "SIGTERM" for SIGTERM.
func SignalName(sig os.Signal) string {
	switch sig {
	case syscall.SIGTERM:
		return "SIGTERM"
	case syscall.SIGINT:
		return "SIGINT"
	}
	return fmt.Sprint(sig)
}

// unitHint is ParseBytes's suggestion for a positive number with a unit
// it does not take (the units are case-sensitive): "80gib" is 80GiB, and
// "80G", as Slurm and Docker write sizes, 80GiB or 80GB; "" otherwise.
func unitHint(t string) string {
	i := strings.IndexFunc(t, func(r rune) bool { return r != '.' && (r < '0' || r > '9') })
	if i <= 0 {
		return ""
	}
	num, unit := t[:i], strings.TrimSpace(t[i:])
	if v, err := strconv.ParseFloat(num, 64); err != nil || !(v > 0) {
		return ""
	}
	for _, u := range []string{"KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "TB"} {
		if strings.EqualFold(unit, u) {
			return fmt.Sprintf(": did you mean %s%s? (units are case-sensitive)", num, u)
		}
	}
	switch p := strings.ToUpper(unit); p {
	case "K", "M", "G", "T":
		return fmt.Sprintf(": did you mean %s%siB (or %s%sB)?", num, p, num, p)
	}
	return ""
}

// ParseBytes reads a byte count with an optional unit: B, KiB, MiB, GiB,
// TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000); a number
// without a unit is bytes. It reads device memory (--device-memory), so a
// number without a unit under 1 MiB is refused as the unit forgotten:
// "--device-memory 80" planned for an 80-byte device, with a negative
// budget, and exited 0.
func ParseBytes(s string) (int64, error) {
	t := strings.TrimSpace(s)
	units := []struct {
		suffix string
		mult   float64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40},
		{"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}, {"B", 1}}
	mult, unit := 1.0, false
	for _, u := range units {
		if strings.HasSuffix(t, u.suffix) {
			t, mult, unit = strings.TrimSpace(strings.TrimSuffix(t, u.suffix)), u.mult, true
			break
		}
	}
	v, err := strconv.ParseFloat(t, 64)
	if err != nil || !(v > 0) || v*mult > 1<<60 {
		return 0, fmt.Errorf("%q: want a positive size such as 80GiB, 141GiB or 85899345920 (units: B, KiB, MiB, GiB, TiB, or KB, MB, GB, TB)%s", s, unitHint(strings.TrimSpace(s)))
	}
	if !unit && v < 1<<20 {
		return 0, fmt.Errorf("%q: a size without a unit is bytes, and %s bytes is no device's memory: did you mean %sGiB?", s, t, t)
	}
	return int64(v * mult), nil
}

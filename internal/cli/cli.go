// Package cli is the subcommand registry shared by the project's commands
// (cachectl, student): each subcommand registers itself from its own file,
// and main dispatches on os.Args[1].
package cli

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"sort"
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

func (r *Registry) usage() {
	fmt.Fprintf(os.Stderr, "usage: %s COMMAND [flags]\n\ncommands:\n", r.prog)
	names := make([]string, 0, len(r.commands))
	for n := range r.commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(os.Stderr, "  %-10s %s\n", n, r.commands[n].Summary)
	}
	fmt.Fprintf(os.Stderr, "\nRun '%s COMMAND -h' for a command's flags.\n", r.prog)
}

// Main dispatches args (os.Args[1:]) and exits: 0 on success, 1 when the
// command fails (its error printed with the program and command name), 2 on
// usage errors.
func (r *Registry) Main(args []string) {
	if len(args) < 1 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		r.usage()
		os.Exit(2)
	}
	c, ok := r.commands[args[0]]
	if !ok {
		fmt.Fprintf(os.Stderr, "%s: unknown command %q\n", r.prog, args[0])
		r.usage()
		os.Exit(2)
	}
	if err := c.Run(args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(2)
		}
		fmt.Fprintf(os.Stderr, "%s %s: %v\n", r.prog, c.Name, err)
		os.Exit(1)
	}
}
